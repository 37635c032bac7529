"""One entry below HTTP: a request body, its caller (tenant, priority class) in; an answer, final or retryable, out.

Batch lines (app/batch/runner.py) and the offline command (app/batch/cli.py) call the serving layer here, as the
routes do over HTTP: the same body checks (app/body.py's limits, the same pydantic models, on a prepare worker), the
same serving code and the same errors, without replaying the ASGI app. So nothing is parsed or written as JSON on
the event loop (an answer's bytes are the serving layer's own, kept as they are), and the tenant is an argument,
not something carried in an ASGI scope.

An answer is `final` when it is one the client would keep: a 2xx, or a 4xx of its own making. A 429, a 503 (the
server is loading, draining, its queue is full or its engine restarting) or a 500 says nothing about the request:
the caller should run it again later (`retryable`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from fastapi.exceptions import RequestValidationError

from app.body import parse_body, validation_error_body
from app.errors import InvalidRequest, ServeError
from app.openai.completions_wire import error_body
from app.openai.embeddings.protocol import EmbeddingRequest
from app.openai.protocol import ChatCompletionRequest, CompletionRequest
from app.openai.responses.protocol import ResponsesRequest
from app.openai.responses.serving import ResponsesServing
from app.prepare import client_left
from app.state import check_ready

log = logging.getLogger("app.entry")
BODIES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
          "/v1/responses": ResponsesRequest, "/v1/embeddings": EmbeddingRequest}
RETRYABLE_4XX = (408, 429, 499)  # too early, too many, or nobody was listening: nothing wrong with the request


@dataclass
class Caller:
    """Who asks. The serving layer reads a request's `state`, `headers`, `client` and `is_disconnected()`; an HTTP
    request gets them from app/api.py's key check, a Caller from whoever builds it."""

    tenant: str | None = None  # an API key's tenant id (app/auth.py); None when the server has no keys
    cache_salted: bool = False  # PREFIX_CACHE_PER_KEY: this tenant's prefix-cache entries are its own
    background: bool = False  # the engine's batch class (app/core/engine/engine.py)
    name: str = "internal"  # who this is in the logs and for the grammar compiler's fair share
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        self.state = SimpleNamespace(tenant=self.tenant, x_request_id=self.request_id, arrived=time.perf_counter(),
                                     background=self.background)
        if self.cache_salted and self.tenant is not None:
            self.state.cache_tenant = self.tenant
        self.headers: dict[str, str] = {}
        self.client = SimpleNamespace(host=self.name, port=0)

    def again(self) -> Caller:
        """The same caller for a new attempt: its own request id and arrival time."""
        return Caller(self.tenant, self.cache_salted, self.background, self.name)

    async def is_disconnected(self) -> bool:
        return False  # a caller below HTTP stops a request by cancelling the task that awaits `call`


@dataclass
class Answer:
    status: int
    body: bytes  # JSON, as the route would have sent it
    request_id: str

    @property
    def final(self) -> bool:
        return 200 <= self.status < 300 or (400 <= self.status < 500 and self.status not in RETRYABLE_4XX)


async def call(state, url: str, body: dict[str, Any], caller: Caller) -> Answer:
    """POST `body` to `url`'s serving code as `caller`; never raises but for cancellation."""
    client_left.set(caller.is_disconnected)
    try:
        status, payload = 200, await _serve(state, url, body, caller)
    except ServeError as err:
        status, payload = err.status, json.dumps(error_body(err)).encode()
    except RequestValidationError as err:
        status, payload = 400, json.dumps(validation_error_body(err)).encode()
    except Exception as err:  # noqa: BLE001 - a bug: this one line fails (retryably), the caller goes on
        log.exception("internal error serving %s for %s", url, caller.name)
        status, payload = 500, json.dumps(error_body(ServeError(f"internal error: {type(err).__name__}"))).encode()
    return Answer(status, payload, caller.request_id)


async def _serve(state, url: str, body: dict[str, Any], caller: Caller) -> bytes:
    check_ready(state)  # the routes' own first check: 503 while loading, draining or dead
    model = BODIES.get(url)
    embedding = url == "/v1/embeddings"
    if model is None or embedding != (state.kind == "embedding"):
        raise InvalidRequest(f"{url} is not served by this server's model", param="url")
    raw = json.dumps(body, ensure_ascii=False).encode()  # on the prepare worker below, with the routes' checks
    parsed = await state.preparing.run(parse_body_dict, raw, model, state.body_limits)
    if embedding:
        answer = await state.embedding.embeddings(parsed, caller)
        return await asyncio.get_running_loop().run_in_executor(  # the vectors' floats: off the loop, uncounted
            state.preparing.executor, lambda: json.dumps(answer, ensure_ascii=False).encode())
    serving = state.serving
    if url == "/v1/responses":
        response = await ResponsesServing(serving).create(parsed, caller)
    elif url == "/v1/completions":
        response = await serving.completion(parsed, caller)
    else:
        response = await serving.chat(parsed, caller)
    return bytes(response.body)


def parse_body_dict(raw: bytes, model: type, limits) -> Any:
    return parse_body(raw, "application/json", model, limits)
