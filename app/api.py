"""Thin HTTP routes. Each one finds the server state, checks access, and hands off to serving.py."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import FileResponse, JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.anthropic.protocol import CountTokensRequest, MessagesRequest
from app.anthropic.serving import MessagesServing
from app.core.detokenize import decode
from app.errors import InvalidRequest, ServeError, ShuttingDown
from app.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                 default_sampling)
from app.openai.responses import ResponsesServing
from app.openai.responses_protocol import ResponsesRequest
from app.openai.serving import CompletionServing
from app.state import ServerState


class Unauthorized(ServeError):
    status = 401
    error_type = "invalid_request_error"

    def __init__(self, message: str):
        super().__init__(message, code="invalid_api_key")


class NotReady(ServeError):
    status = 503
    error_type = "server_error"


def get_state(request: Request) -> ServerState:
    return request.app.state.serve


State = Annotated[ServerState, Depends(get_state)]


def require_api_key(request: Request, state: State) -> None:
    if not state.api_keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    bearer = token.strip() if scheme.lower() == "bearer" else ""
    # compared in constant time (app/auth.py); `x-api-key` is Anthropic's header
    tenant = state.api_keys.tenant(bearer, request.headers.get("x-api-key", "").strip())
    if tenant is None:
        raise Unauthorized("missing or wrong API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`")
    if state.settings.prefix_cache_per_key:
        request.state.cache_tenant = tenant  # the serving layer salts the prefix cache with it


def get_serving(state: State) -> CompletionServing:
    if state.draining:
        raise ShuttingDown()
    if error := state.engine_error:
        raise NotReady(error, code="engine_dead")
    if not state.ready:
        raise NotReady(state.load_error or "the model is still loading; retry when /ready answers 200",
                       code="model_not_ready")
    return state.serving


Serving = Annotated[CompletionServing, Depends(get_serving)]
public = APIRouter()
router = APIRouter(dependencies=[Depends(require_api_key)])
WEB_DIR = Path(__file__).parent / "web"  # the playground's static files, shipped in the package (main.py mounts them)


@public.get("/", include_in_schema=False)
async def playground() -> FileResponse:
    return FileResponse(WEB_DIR / "index.html")


@public.get("/health")
async def health(state: State) -> JSONResponse:
    # Liveness: 503 once the engine thread has died, so an orchestrator restarts the process.
    if error := state.engine_error:
        return JSONResponse({"status": "dead", "error": error}, status_code=503)
    return JSONResponse({"status": "ok"})


@public.get("/ready")
async def ready(state: State) -> JSONResponse:
    if error := state.engine_error:
        return JSONResponse({"status": "dead", "error": error}, status_code=503)
    if state.ready and not state.draining:
        return JSONResponse({"status": "ready", "model": state.settings.model_id, **state.model_info})
    status = "draining" if state.draining else ("failed" if state.load_error else "loading")
    return JSONResponse({"status": status, "error": state.load_error}, status_code=503)


@public.get("/metrics")
async def metrics(request: Request, state: State) -> Response:
    if state.settings.metrics_require_key:
        require_api_key(request, state)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, serving: Serving):
    return await serving.chat(body, request)


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request, serving: Serving):
    return await ResponsesServing(serving).create(body, request)


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request, serving: Serving):
    return await MessagesServing(serving).create(body, request)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, serving: Serving) -> dict:
    return await MessagesServing(serving).count_tokens(body)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, serving: Serving):
    return await serving.completion(body, request)


@router.get("/v1/models")
async def list_models(state: State) -> dict:
    lm = state.lm
    model = {"id": state.settings.model_id, "object": "model", "created": 0, "owned_by": "simple-serve",
             "max_model_len": lm.max_context if lm else state.settings.max_model_len, **state.model_info}
    if lm:
        model["sampling_defaults"] = default_sampling(lm.generation_defaults)
    return {"object": "list", "data": [model]}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, serving: Serving) -> dict:
    if body.model is not None:
        serving.check_model(body.model)
    if body.messages is not None:
        ids = await serving.encode_messages(body.chat_messages(), add_generation_prompt=body.add_generation_prompt)
    elif body.prompt is not None:
        ids = await serving.encode_text(body.prompt)
    else:
        raise InvalidRequest("give `prompt` or `messages`", param="prompt")
    return {"tokens": ids, "count": len(ids), "max_model_len": serving.lm.max_context}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, serving: Serving) -> dict:
    if body.model is not None:
        serving.check_model(body.model)
    bad = [t for t in body.tokens if not 0 <= t < len(serving.lm.tokenizer)]
    if bad:
        raise InvalidRequest(f"token ids outside the vocabulary: {bad[:5]}", param="tokens")
    return {"prompt": decode(serving.lm.tokenizer, body.tokens)}
