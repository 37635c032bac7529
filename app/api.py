"""Thin HTTP routes. Each one finds the server state, checks access, and hands off to serving.py.

A JSON body is not FastAPI's to parse: that would parse and validate it on the event loop. `parsed(Model)` reads it
and hands it to a prepare worker (app/body.py, app/prepare.py), after the key and readiness checks; the OpenAPI
schema still shows the model (`body_schema`, completed in app/main.py's `served_openapi`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import FileResponse, JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect

from app.anthropic.protocol import CountTokensRequest, MessagesRequest
from app.anthropic.serving import MessagesServing
from app.body import parse_body
from app.core.detokenize import decode
from app.errors import InvalidRequest, ServeError
from app.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                 default_sampling)
from app.openai.embeddings.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from app.openai.embeddings.serving import ENDPOINTS as EMBEDDING_ENDPOINTS, EmbeddingServing
from app.openai.adapters import (LoadLoraAdapterRequest, UnloadLoraAdapterRequest, adapter_models, load_adapter,
                                 runtime_adapters, unload_adapter)
from app.openai.responses.serving import ResponsesServing
from app.openai.responses.protocol import ResponsesRequest
from app.openai.serving import CompletionServing
from app.prepare import ClientGone, client_left
from app.state import ServerState, check_ready

M = TypeVar("M")


class Unauthorized(ServeError):
    status = 401
    error_type = "invalid_request_error"

    def __init__(self, message: str):
        super().__init__(message, code="invalid_api_key")


def get_state(request: Request) -> ServerState:
    return request.app.state.serve


State = Annotated[ServerState, Depends(get_state)]


def require_api_key(request: Request, state: State) -> None:
    if not state.api_keys:
        return
    tenant = state.api_keys.tenant_of_headers(request.headers)  # compared in constant time (app/auth.py)
    if tenant is None:
        raise Unauthorized("missing or wrong API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`")
    # who owns what it creates: LoRA adapters (app/models/lora.py), files and batches (app/batch/)
    request.state.tenant = tenant
    if state.settings.prefix_cache_per_key:
        request.state.cache_tenant = tenant  # the serving layer salts the prefix cache with it


CHAT_ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/tokenize",
                  "/detokenize"]


def get_serving(state: State) -> CompletionServing:
    if state.kind == "embedding":
        served = state.embedding.endpoints if state.embedding else EMBEDDING_ENDPOINTS
        raise InvalidRequest(f"{state.settings.model_id} is an embedding model: it serves "
                             f"{', '.join(served)}, not chat or text generation", param="model",
                             code="unsupported_endpoint")
    check_ready(state)
    return state.serving


def get_embedding_serving(state: State) -> EmbeddingServing:
    if state.kind != "embedding":
        raise InvalidRequest(f"{state.settings.model_id} is a chat model: it serves {', '.join(CHAT_ENDPOINTS)}, "
                             "not embeddings, rerank or score", param="model", code="unsupported_endpoint")
    check_ready(state)
    return state.embedding


Serving = Annotated[CompletionServing, Depends(get_serving)]
Embedding = Annotated[EmbeddingServing, Depends(get_embedding_serving)]
BODY_MODELS: list[type] = []  # every model a route parses itself, for the OpenAPI schema's components


def parsed(model: type[M], serving: Any = get_serving) -> Any:
    """A dependency: the request body as `model`, parsed and validated on a prepare worker, once `serving` (the
    checks that this model serves the route and is ready) has passed."""
    async def parse(request: Request, state: State, _: Any = Depends(serving)) -> M:
        try:
            raw = await request.body()  # on the loop, but only a join of the chunks already received
        except ClientDisconnect:  # gone while sending it: a 499 nobody reads, not an unhandled error's 500
            raise ClientGone() from None
        client_left.set(request.is_disconnected)  # for this request's later prepare jobs, too (tokenizing)
        return await state.preparing.run(parse_body, raw, request.headers.get("content-type"), model,
                                         state.body_limits)
    BODY_MODELS.append(model)
    return Depends(parse)


def body_schema(model: type) -> dict[str, Any]:
    """The `openapi_extra` FastAPI would have written for a `model` body: required JSON, and its 422."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    invalid = {"$ref": "#/components/schemas/HTTPValidationError"}
    return {"requestBody": {"content": {"application/json": {"schema": ref}}, "required": True},
            "responses": {"422": {"description": "Validation Error", "content": {"application/json": {
                "schema": invalid}}}}}


ChatBody = Annotated[ChatCompletionRequest, parsed(ChatCompletionRequest)]
CompletionBody = Annotated[CompletionRequest, parsed(CompletionRequest)]
ResponsesBody = Annotated[ResponsesRequest, parsed(ResponsesRequest)]
MessagesBody = Annotated[MessagesRequest, parsed(MessagesRequest)]
CountTokensBody = Annotated[CountTokensRequest, parsed(CountTokensRequest)]
TokenizeBody = Annotated[TokenizeRequest, parsed(TokenizeRequest)]
DetokenizeBody = Annotated[DetokenizeRequest, parsed(DetokenizeRequest)]
EmbeddingBody = Annotated[EmbeddingRequest, parsed(EmbeddingRequest, get_embedding_serving)]
RerankBody = Annotated[RerankRequest, parsed(RerankRequest, get_embedding_serving)]
ScoreBody = Annotated[ScoreRequest, parsed(ScoreRequest, get_embedding_serving)]
LoadLoraBody = Annotated[LoadLoraAdapterRequest, parsed(LoadLoraAdapterRequest)]
UnloadLoraBody = Annotated[UnloadLoraAdapterRequest, parsed(UnloadLoraAdapterRequest)]
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


@public.get("/health/generate")
async def health_generate(state: State) -> JSONResponse:
    # Liveness that sees the engine: 200 only with proof of forward progress (app/probes.py).
    status, body = await state.probe.check(state)
    return JSONResponse(body, status_code=status)


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


@router.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
async def chat_completions(body: ChatBody, request: Request, serving: Serving):
    return await serving.chat(body, request)


@router.post("/v1/responses", openapi_extra=body_schema(ResponsesRequest))
async def responses(body: ResponsesBody, request: Request, serving: Serving):
    return await ResponsesServing(serving).create(body, request)


@router.post("/v1/messages", openapi_extra=body_schema(MessagesRequest))
async def messages(body: MessagesBody, request: Request, serving: Serving):
    return await MessagesServing(serving).create(body, request)


@router.post("/v1/messages/count_tokens", openapi_extra=body_schema(CountTokensRequest))
async def count_tokens(body: CountTokensBody, request: Request, serving: Serving) -> dict:
    return await MessagesServing(serving).count_tokens(body, getattr(request.state, "tenant", None))


@router.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
async def completions(body: CompletionBody, request: Request, serving: Serving):
    return await serving.completion(body, request)


@router.get("/v1/models")
async def list_models(request: Request, state: State) -> dict:
    lm = state.lm
    embedding = state.kind == "embedding"
    model = {"id": state.settings.model_id, "object": "model", "created": 0, "owned_by": "simple-serve",
             "max_model_len": lm.max_context if lm else state.settings.max_model_len, **state.model_info,
             "endpoints": CHAT_ENDPOINTS}
    if embedding:
        model["endpoints"] = state.embedding.endpoints if state.embedding else EMBEDDING_ENDPOINTS
    if lm and embedding:
        if not lm.scores_pairs:
            model["dimensions"] = lm.dimensions
    elif lm:
        model["sampling_defaults"] = default_sampling(lm.generation_defaults)
        # whether a request may send images (app/models/vision.py): the playground offers its attach button on it
        model["capabilities"] = {"vision": getattr(lm, "vision", None) is not None}
    if lm and getattr(lm, "weight_bytes", None):  # by format (app/models/weight_memory.py)
        model["weight_bytes"] = {"total": sum(lm.weight_bytes.values()), **lm.weight_bytes}
    adapters = adapter_models(state.adapters, state.settings.model_id, getattr(request.state, "tenant", None))
    return {"object": "list", "data": [model, *adapters]}


def tenant_of(request: Request) -> str:
    # "" when no key is set (runtime loading is refused at start then): never None, the start-up adapters' owner
    return getattr(request.state, "tenant", "")


def require_runtime_loading(state: State) -> None:
    runtime_adapters(state.adapters)  # 404 when LORA_RUNTIME_LOADING is off, before the body is read
    # (a route's own dependencies run after the router's API-key check and before its body's)


@router.post("/v1/load_lora_adapter", openapi_extra=body_schema(LoadLoraAdapterRequest),
             dependencies=[Depends(require_runtime_loading), Depends(get_serving)])
async def load_lora_adapter(body: LoadLoraBody, request: Request, state: State) -> dict:
    return await load_adapter(runtime_adapters(state.adapters), body, tenant_of(request))


@router.post("/v1/unload_lora_adapter", openapi_extra=body_schema(UnloadLoraAdapterRequest),
             dependencies=[Depends(require_runtime_loading), Depends(get_serving)])
async def unload_lora_adapter(body: UnloadLoraBody, request: Request, state: State) -> dict:
    return unload_adapter(runtime_adapters(state.adapters), body, tenant_of(request))


@router.post("/v1/embeddings", openapi_extra=body_schema(EmbeddingRequest))
async def embeddings(body: EmbeddingBody, request: Request, serving: Embedding) -> JSONResponse:
    # plain JSON types already: skips FastAPI's jsonable_encoder, which visits each of the vectors' floats
    return JSONResponse(await serving.embeddings(body, request))


@router.post("/v1/rerank", openapi_extra=body_schema(RerankRequest))
async def rerank(body: RerankBody, request: Request, serving: Embedding) -> dict:
    return await serving.rerank(body, request)


@router.post("/v1/score", openapi_extra=body_schema(ScoreRequest))
async def score(body: ScoreBody, request: Request, serving: Embedding) -> dict:
    return await serving.score(body, request)


@router.post("/tokenize", openapi_extra=body_schema(TokenizeRequest))
async def tokenize(body: TokenizeBody, request: Request, serving: Serving) -> dict:
    if body.model is not None:
        serving.check_model(body.model, getattr(request.state, "tenant", None))
    if body.messages is not None:
        # as a completion counts them: a vision model's images expanded to their tokens, a text model's refused
        ids, _ = await serving.encode_prompt(body.chat_messages(), body.image_parts(),
                                             add_generation_prompt=body.add_generation_prompt)
    elif body.prompt is not None:
        ids = await serving.encode_text(body.prompt)
    else:
        raise InvalidRequest("give `prompt` or `messages`", param="prompt")
    return {"tokens": ids, "count": len(ids), "max_model_len": serving.lm.max_context}


@router.post("/detokenize", openapi_extra=body_schema(DetokenizeRequest))
async def detokenize(body: DetokenizeBody, request: Request, serving: Serving) -> dict:
    if body.model is not None:
        serving.check_model(body.model, getattr(request.state, "tenant", None))
    return {"prompt": await serving.preparing.run(checked_decode, serving.lm.tokenizer, body.tokens,
                                                  serving.lm.max_context)}


def checked_decode(tokenizer, ids: list[int], limit: int) -> str:
    """/detokenize's work, on a prepare worker: on the loop, 3 clients sending 250,000 ids each put /health's p99
    at 438 ms."""
    if len(ids) > limit:
        raise InvalidRequest(f"`tokens` has {len(ids):,} ids; at most {limit:,} (the context window) are accepted",
                             param="tokens", code="too_many_items")
    bad = [t for t in ids if not 0 <= t < len(tokenizer)]
    if bad:
        raise InvalidRequest(f"token ids outside the vocabulary: {bad[:5]}", param="tokens")
    return decode(tokenizer, ids)
