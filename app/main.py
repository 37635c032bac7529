"""create_app(): the FastAPI app, its lifespan, error handling, and the ASGI layers around the routes (the catch-all
500, the body limit, the access line). The process that runs it, with its graceful drain: app/server.py."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.encoders import jsonable_encoder
from fastapi.openapi.models import Schema
from fastapi.openapi.utils import validation_error_definition, validation_error_response_definition
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException

from app.anthropic.errors import anthropic_error, anthropic_status, is_messages_path
from app.api import BODY_MODELS, WEB_DIR, Unauthorized, public, require_api_key, router
from app.batch.routes import router as batch_router
from app.batch.service import open_batch_service
from app.batch.store import Store, StoreError
from app.batch.uploads import ENVELOPE_BYTES
from app.body import validation_error_body
from app.config import Settings
from app.errors import ConfigError, ServeError
from app.logs import escape_controls, served_model
from app.request_id import current as current_request_id, request_id_from
from app.models.loading import LoadedModel
from app.openai.serving import error_body
from app.state import ServerState

log = logging.getLogger("app.access")
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
COUNTED_PATHS = GENERATION_PATHS + ("/v1/embeddings", "/v1/rerank", "/v1/score")  # /metrics' `endpoint` label


def create_app(settings: Settings | None = None, lm: LoadedModel | None = None) -> FastAPI:
    """`lm` lets tests and embedders hand in a model that is already loaded."""
    settings = settings or Settings()
    state = ServerState(settings, lm)
    state.batch_store = open_batch_store(settings.batch_dir)  # an unusable BATCH_DIR is refused now, at start

    async def load() -> None:
        await state.load()
        if state.ready and state.batch_store is not None:
            state.batches = open_batch_service(state)  # resumes unfinished batches

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.create_task(load())  # serve /health while the model loads
        try:
            yield
        finally:
            loading.cancel()
            if state.batches is not None:
                await state.batches.runner.stop()  # lines in flight have no row yet: the next start runs them
            await asyncio.to_thread(state.close)

    app = FastAPI(title="simple-serve", version="0.1.0", lifespan=lifespan)
    app.state.serve = state
    app.include_router(public)
    app.include_router(router)
    app.include_router(batch_router)
    app.mount("/web", StaticFiles(directory=WEB_DIR), name="web")  # the playground's script and style
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-sampling-params", "x-request-id"])
    app.add_middleware(AccessAndLimits, state=state)
    app.add_middleware(CatchAll)  # outermost of ours: also catches what the middlewares above raise
    install_error_handlers(app)
    app.openapi = partial(served_openapi, app, settings.model_id)
    return app


def open_batch_store(batch_dir) -> Store | None:
    if batch_dir is None:
        return None
    try:
        return Store(batch_dir)
    except StoreError as err:
        raise ConfigError(str(err), param="batch_dir") from None


def served_openapi(app: FastAPI, model_id: str) -> dict:
    """FastAPI's schema, plus what only this server knows: `model` takes the one id it serves (any other is a 404),
    so clients and the fuzzer (tests/server/test_fuzz.py) see the real contract."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        # The bodies the routes parse themselves (app/api.py `parsed`): their models, as FastAPI would list them.
        _, defs = models_json_schema([(m, "validation") for m in BODY_MODELS],
                                     ref_template="#/components/schemas/{model}")
        defs = defs["$defs"] | {"ValidationError": validation_error_definition,
                                "HTTPValidationError": validation_error_response_definition}
        schema.setdefault("components", {}).setdefault("schemas", {}).update(
            {name: jsonable_encoder(Schema(**d), by_alias=True, exclude_none=True) for name, d in defs.items()})
        for component in schema.get("components", {}).get("schemas", {}).values():
            model = component.get("properties", {}).get("model")
            for branch in (model.get("anyOf", [model]) if model else []):
                if branch.get("type") == "string":
                    branch["enum"] = [model_id]
    return app.openapi_schema


def error_response(request: Request, status: int, body: dict, headers: dict | None = None) -> JSONResponse:
    """OpenAI's error shape; on Anthropic's routes (/v1/messages...), Anthropic's (app/anthropic/errors.py)."""
    if is_messages_path(request.url.path):
        status = anthropic_status(status)
        body = anthropic_error(status, body["error"]["message"])
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServeError)
    async def serve_error(request: Request, err: ServeError) -> JSONResponse:
        retry_after = getattr(err, "retry_after_s", None)  # Overloaded, QueueTimeout
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
        return error_response(request, err.status, error_body(err), headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        return error_response(request, 400, validation_error_body(err))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        return error_response(request, err.status_code, {"error": {
            "message": str(err.detail), "type": "invalid_request_error", "param": None, "code": None}}, err.headers)


class CatchAll:
    """Pure ASGI middleware, the last word on an exception no handler knew: a 500 in the route's error shape, and
    the traceback logged from a worker thread, bounded by app/logs.py's formatter. Starlette's own catch-all (an
    `Exception` handler) hands the exception on to uvicorn after answering, which logs the whole traceback again on
    the event loop (512 KB for one RecursionError) and closes the keep-alive connection, which a proxy may share."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as err:
            # in a thread: the handler formats the traceback and writes it (to a pipe that may be slow to drain)
            await asyncio.to_thread(logging.getLogger("app").error, "unhandled error in %s %s", scope.get("method"),
                                    escape_controls(scope.get("path", "")), exc_info=err)
            if not started:  # else a response is half sent: nothing more can be said on it
                request_id = scope.get("state", {}).get("x_request_id")
                await error_response(Request(scope), 500, {"error": {
                    "message": f"internal error: {type(err).__name__}", "type": "server_error", "param": None,
                    "code": None}}, {"x-request-id": request_id} if request_id else None)(scope, receive, send)


class AccessAndLimits:
    """Pure ASGI middleware: rejects oversized bodies before they are read whole, counts requests by status,
    and writes one access line per request when its response (streamed or not) has been sent.

    Uploads (POST /v1/files) may be BATCH_MAX_FILE_BYTES, not MAX_REQUEST_BYTES, only where the Files API is on
    (BATCH_DIR) and only once their key is checked, here, before any of the body is read: a 100 MiB upload without
    a key is a 401 on its headers alone. An upload answered before its body was read whole (a 401, a quota, a wrong
    `purpose`) closes its connection, so that the server never drains a body it refused."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        upload_path = scope.get("path") == "/v1/files" and scope.get("method") == "POST"
        uploads = upload_path and self.state.batch_store is not None
        settings = self.state.settings
        limit = (settings.batch_max_file_bytes + ENVELOPE_BYTES if uploads
                 else settings.max_vision_request_bytes if getattr(self.state.lm, "vision", None) is not None
                 else settings.max_request_bytes)
        started = time.perf_counter()
        status = {"code": 500}
        headers = dict(scope.get("headers", []))
        request_id = request_id_from(headers.get(b"x-request-id"))
        info = scope.setdefault("state", {})
        info["x_request_id"], info["arrived"], info["arrived_ns"] = request_id, started, time.time_ns()
        id_header = (b"x-request-id", request_id.encode("ascii"))
        token = current_request_id.set(request_id)  # the request's tasks inherit it: its log lines carry it
        if uploads:
            try:
                require_api_key(Request(scope), self.state)  # the router checks it again, as for every route
            except Unauthorized as err:
                try:
                    return await self._refuse(send, 401, error_body(err), scope, [id_header, CLOSE])
                finally:
                    current_request_id.reset(token)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            try:
                return await self._too_large(send, limit, scope, [id_header, CLOSE] if upload_path else [id_header])
            finally:
                current_request_id.reset(token)
        received, too_large, body_read = 0, False, False

        async def limited_receive():
            nonlocal received, too_large, body_read
            message = await receive()
            received += len(message.get("body", b""))
            body_read = body_read or not message.get("more_body", False)
            if received > limit:  # chunked bodies carry no content-length
                too_large = True
                raise BodyTooLarge()
            return message

        async def tracking_send(message):
            if too_large:
                return  # FastAPI turns a failed body read into its own 400; the answer is our 413
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                close = [CLOSE] if upload_path and not body_read else []
                message = {**message, "headers": [*message.get("headers", []), id_header, *close]}
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            pass
        finally:
            try:
                if too_large:
                    await self._too_large(send, limit, scope, [id_header])
                else:
                    self._log(scope, status["code"], started)
                    if self.state.tracing is not None and scope.get("path") in GENERATION_PATHS:
                        self.state.tracing.record(scope, info, status["code"])
            finally:
                current_request_id.reset(token)

    async def _too_large(self, send, limit: int, scope, headers: list[tuple[bytes, bytes]]) -> None:
        message = f"request body exceeds {limit} bytes"
        error = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                           "code": "request_too_large"}}
        await self._refuse(send, 413, anthropic_error(413, message) if is_messages_path(scope.get("path", ""))
                           else error, scope, headers)

    async def _refuse(self, send, status: int, error: dict, scope, headers: list[tuple[bytes, bytes]]) -> None:
        body = json.dumps(error).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *headers]})
        await send({"type": "http.response.body", "body": body})
        self._log(scope, status, time.perf_counter())

    def _log(self, scope, status: int, started: float) -> None:
        path = scope.get("path", "")
        if path in ("/health", "/health/generate", "/ready", "/metrics"):
            return  # probes every few seconds would drown the log
        info = scope.get("state", {})
        # A stream that failed after its 200 counts as the error it ended with (the client saw an error event).
        status = info.get("failed_status", status)
        self.state.metrics.requests.labels(path if path in COUNTED_PATHS else "other", str(status)).inc()
        ttft = info.get("ttft_s")
        duration = time.perf_counter() - started
        reasons = info.get("finish_reasons")
        # the path as received, but on one line: `%0a` in a URL must not write a forged line of its own
        # the response's id (chatcmpl-<request id>) once it has one, else the request id itself
        log.info("%s %s %s %d prompt=%s completion=%s%s duration=%.3fs",
                 info.get("request_id") or info.get("x_request_id", "-"),
                 scope.get("method"), escape_controls(path), status, info.get("prompt_tokens", "-"),
                 info.get("completion_tokens", "-"),
                 f" ttft={ttft:.3f}s" if ttft is not None else "", duration,
                 extra={"cancelled": info.get("cancelled", False), "request_id": info.get("x_request_id"),
                        "method": scope.get("method"), "path": path, "status": status,
                        "model": served_model(info, self.state.settings.model_id)
                        if "prompt_tokens" in info else None,
                        "prompt_tokens": info.get("prompt_tokens"), "completion_tokens": info.get("completion_tokens"),
                        "ttft_s": round(ttft, 6) if ttft is not None else None, "duration_s": round(duration, 6),
                        "finish_reason": (reasons[0] if len(reasons) == 1 else reasons) if reasons else None})


class BodyTooLarge(Exception):
    pass


CLOSE = (b"connection", b"close")
