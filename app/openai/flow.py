"""One serving flow for every generating API: the create flow and the stream loop, written once.

Chat completions, completions, Responses and Messages differ only in their wire format; each is a `WireApi` that
says how its request becomes the chat or completion request it means (`prepare`), how its answer is written
(`events` for a stream, `whole` for one JSON body), how a failure after the 200 is told in-band (`error_event`),
which field names it uses (`param_names`), and after which outcomes its stream ends with `data: [DONE]`
(`done_after`). Everything else is here, as vLLM's serving classes share `OpenAIServing`:

- `create`: check the model, build the request and encode its prompt (off the loop), compile its grammar, start
  its choices, then stream or collect them; an error names the field as this API's client sent it.
- `stream_loop`: the only place a stream ends. Finished: its last events, then [DONE] if the API sends one.
  Failed (a `ServeError` after the 200, an engine failure or a deadline's error): logged, counted under its status
  (`failed_status`), told in-band, its sibling choices stopped by us (not counted as client cancellations).
  The client left (the generator is closed at a yield): every choice is cancelled at once. Timings are recorded
  for the access log line whichever way it ended.

A deadline is not a failure: the engine ends the generation with finish reason "timeout", and each API writes
that as its own documented reason (docs/operations.md) through its usual last events.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Mapping

from fastapi import Request
from fastapi.responses import Response

from app.errors import InvalidRequest, ServeError
from app.openai.answer import Choice
from app.openai.sse import event_stream
from app.openai.stream_parts import record_timing

log = logging.getLogger("app.openai.flow")
FINISHED, FAILED = "finished", "failed"  # how a stream ended; a client that left is neither
DONE = {"data": "[DONE]"}


@dataclass
class Prepared:
    """A request ready for the engine: the chat or completion request its API means, and its prompt ids."""

    request: Any  # a ChatCompletionRequest or CompletionRequest: what `CompletionServing.start` reads
    prompt_ids: list[int]
    chat: bool = True  # a chat answer (reasoning split, tool calls), not a text completion
    prompt: Any = None  # a completion's prompt as sent (text or ids), for its echo
    images: Any = None  # app/models/vision.py's ImagePrompt: the embeddings of the prompt's images, if it has any


class WireApi:
    """One API's wire format on top of the shared flow. Subclasses say only what differs."""

    done_after: frozenset[str] = frozenset({FINISHED, FAILED})  # outcomes after which `data: [DONE]` is sent
    param_names: Mapping[str, str] = {}  # the chat request's field names -> this API's, for error params

    def __init__(self, serving):
        self.serving = serving  # app/openai/serving.py's CompletionServing (which imports this module)

    async def prepare(self, body) -> Prepared:
        raise NotImplementedError

    def answer(self, body, prepared: Prepared, choices: list[Choice], request: Request) -> Any:
        """The answer being written (anything with an `id`, the response id the access log names)."""
        raise NotImplementedError

    def events(self, answer, choices: list[Choice], request: Request) -> AsyncIterator[dict[str, str] | bytes]:
        """The stream's events: dicts as sse_starlette takes them, or an event already encoded (app/openai/sse.py)."""
        raise NotImplementedError

    def error_event(self, answer, err: ServeError) -> dict[str, str]:
        raise NotImplementedError

    async def whole(self, answer, choices: list[Choice], headers: dict[str, str]) -> Response:
        raise NotImplementedError

    def renamed(self, err: ServeError) -> ServeError:
        err.param = self.param_names.get(err.param, err.param)
        return err


async def create(api: WireApi, body, request: Request) -> Response:
    """The one create flow (see the module docstring)."""
    serving = api.serving
    serving.check_model(body.model, getattr(request.state, "tenant", None))
    try:
        prepared = await api.prepare(body)
        grammar = await serving.grammar(prepared.request, request)  # response_format, a forced tool call
        choices, headers = serving.start(prepared.request, request, prepared.prompt_ids, prepared.chat, grammar,
                                        prepared.images)
        answer = api.answer(body, prepared, choices, request)
        request.state.request_id = answer.id
        if body.stream:
            await serving.started(choices)
            return event_stream(stream_loop(api, answer, choices, request), headers, serving.sse_send_timeout_s)
        await serving.collect(choices, request)
        return await api.whole(answer, choices, headers)
    except InvalidRequest as err:  # the chat path names its own fields: name the ones this client sent
        raise api.renamed(err)


async def stream_loop(api: WireApi, answer, choices: list[Choice],
                      request: Request) -> AsyncIterator[dict[str, str] | bytes]:
    """The one stream loop (see the module docstring)."""
    outcome = None
    try:
        async for event in api.events(answer, choices, request):
            yield event
        outcome = FINISHED
    except ServeError as err:  # after the 200: tell the client in-band, then end the stream as this API does
        outcome = FAILED
        log.warning("stream %s failed: %s", answer.id, err.message)
        request.state.failed_status = err.status  # counted and logged as the error it is, not as a 200
        yield api.error_event(answer, api.renamed(err))
    finally:
        if outcome != FINISHED:
            for c in choices:  # after a failure, the siblings are stopped by us, not by the client
                c.handle.cancel(client_left=outcome is None)
            request.state.cancelled = outcome is None
        record_timing(request, choices)
    if outcome in api.done_after:
        yield DONE
