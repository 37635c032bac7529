"""Anthropic's Messages API: the shared flow underneath (app/openai/flow.py: the chat completions path and the one
stream loop), Anthropic's wire shape on top (`MessagesApi`).

The request becomes the chat request it means (protocol.py), so the template, sampling parameters, grammar, engine,
reasoning split, tool-call parsers, limits and metrics are the chat path's own. What differs is how the answer is
written:
- `content` is a list of blocks: `thinking` (a reasoning model's thinking), `text`, and one `tool_use` per tool call
  with its arguments parsed into an `input` object (its id is the chat call id with Anthropic's `toolu_` prefix);
- `stop_reason` is `end_turn`, `max_tokens`, `stop_sequence` (with the matched `stop_sequence`) or `tool_use`;
- `usage` splits the prompt as Anthropic does: `input_tokens` are the ones computed, `cache_read_input_tokens` the
  ones the prefix cache supplied (their sum is the prompt), `output_tokens` all generated tokens;
- a stream is `message_start`, then per block `content_block_start`, its deltas (`thinking_delta`, `text_delta`,
  `input_json_delta`, never an empty one) and `content_block_stop`, then `message_delta` (stop reason and final
  usage) and `message_stop`. `ping` comes whenever nothing else has for PING_S (a long prompt prefilling). A
  failure after the 200 is an `error` event, and the stream ends there; no stream ends with `[DONE]`.
Whitespace alone (the model's newline before a tool call, say) makes no text block; Claude's answers have none.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from app.anthropic.errors import anthropic_error, anthropic_status
from app.anthropic.protocol import CHAT_TO_MESSAGES_PARAM, CountTokensRequest, MessagesRequest, _Conversation
from app.errors import InvalidRequest, ServeError
from app.openai.answer import Choice, Delta, choice_calls
from app.openai.flow import Prepared, WireApi, create
from app.openai.serving import CompletionServing
PING_S = 5.0  # a `ping` event after this long without any other
# A deadline's "timeout" is Anthropic's "max_tokens": the answer was cut short by a limit, which is what its clients
# know how to show; Anthropic has no reason of its own for it (docs/operations.md).
STOP_REASONS = {"length": "max_tokens", "timeout": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}


class MessagesServing:
    """The routes' entry points (app/api.py)."""

    def __init__(self, serving: CompletionServing):
        self.serving = serving

    async def count_tokens(self, body: CountTokensRequest, tenant: str | None = None) -> dict[str, int]:
        """The prompt a Messages request would get, counted by the served model's own tokenizer and template.
        `tenant`: the caller's API key, whose runtime adapters `model` may name."""
        self.serving.check_model(body.model, tenant)
        api = MessagesApi(self.serving)
        try:
            prepared = await api.prepare(body)
        except InvalidRequest as err:
            raise api.renamed(err)
        return {"input_tokens": len(prepared.prompt_ids)}

    async def create(self, body: MessagesRequest, request: Request):
        return await create(MessagesApi(self.serving), body, request)


class MessagesApi(WireApi):
    done_after = frozenset()  # Anthropic's streams end with message_stop, or with an error event
    param_names = CHAT_TO_MESSAGES_PARAM

    async def prepare(self, body: _Conversation) -> Prepared:
        # validates the chat request: on a prepare worker, not on the loop
        chat = await self.serving.preparing.run(body.to_chat_request, self.serving.reasoning is not None)
        return await self.serving.prepare_chat(chat, continue_final=body.prefill)

    def answer(self, body: MessagesRequest, prepared: Prepared, choices: list[Choice], request: Request) -> Answer:
        return Answer(self.serving.served_name(choices), len(prepared.prompt_ids),
                      getattr(request.state, "x_request_id", None))

    async def events(self, answer: Answer, choices: list[Choice], request: Request) -> AsyncIterator[dict]:
        yield answer.event("message_start", message=answer.message(None))
        async with aclosing(with_pings(self.serving.deltas(choices), PING_S)) as items:
            async for item in items:
                if item is None:
                    yield answer.event("ping")
                    continue
                choice, delta = item
                for event in answer.delta_events(delta):
                    yield event
                if delta.finish_reason is not None:
                    for event in answer.close():
                        yield event
                    final = answer.message(choice)
                    yield answer.event("message_delta", usage=final["usage"], delta={
                        "stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]})
                    yield answer.event("message_stop")
                    return  # the last event: no ping may follow it while the handle closes

    def error_event(self, answer: Answer, err: ServeError) -> dict[str, str]:  # Anthropic's shape
        return {"event": "error", "data": json.dumps(anthropic_error(anthropic_status(err.status), err.message))}

    async def whole(self, answer: Answer, choices: list[Choice], headers: dict[str, str]) -> JSONResponse:
        choice = choices[0]
        answer.delta_events(Delta("".join(choice.reasoning), "".join(choice.text), finish_reason=choice.finish_reason,
                                  tool_calls=choice_calls(choice)))
        answer.close()
        return JSONResponse(answer.message(choice), headers=headers)


async def with_pings(items: AsyncIterator, every: float) -> AsyncIterator:
    """`items`, with a None wherever `every` seconds pass without one."""
    iterator = items.__aiter__()
    while True:
        step = asyncio.ensure_future(iterator.__anext__())
        try:
            while not (await asyncio.wait([step], timeout=every))[0]:
                yield None
            try:
                item = step.result()
            except StopAsyncIteration:
                return
        finally:
            step.cancel()  # the client left while we waited: stop the generation behind it
        yield item


class Answer:
    """One message being written: its content blocks so far, and the events that announce them."""

    def __init__(self, model_id: str, input_tokens: int, request_id: str | None = None):
        self.id = "msg_" + (request_id or uuid.uuid4().hex[:24])
        self.model_id = model_id
        self.input_tokens = input_tokens
        self.blocks: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the block still receiving deltas (the last one), if any
        self.arguments = ""  # the open tool_use block's input, as JSON text so far
        self.held = ""  # whitespace not yet shown: it becomes text only if more text follows

    def message(self, choice: Choice | None) -> dict[str, Any]:
        """The message object: empty and unfinished for `message_start` (choice None), else the final one."""
        stop_reason = stop_sequence = None
        cached = output = 0
        if choice is not None:
            stop_reason = STOP_REASONS.get(choice.finish_reason, "end_turn")
            if choice.finish_reason == "stop" and choice.stop_string is not None:
                stop_reason, stop_sequence = "stop_sequence", choice.stop_string
            cached, output = choice.handle.cached_tokens, choice.tokens
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model_id,
                "content": self.blocks if choice is not None else [], "stop_reason": stop_reason,
                "stop_sequence": stop_sequence,
                "usage": {"input_tokens": self.input_tokens - cached, "output_tokens": output,
                          "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}}

    def event(self, kind: str, **fields: Any) -> dict[str, str]:
        return {"event": kind, "data": json.dumps({"type": kind, **fields}, ensure_ascii=False)}

    def delta_events(self, delta: Delta) -> list[dict[str, str]]:
        """Events for one delta: thinking, then text, then tool calls, each kind in blocks of its own."""
        events: list[dict[str, str]] = []
        if delta.reasoning:
            events += self._text_into("thinking", delta.reasoning)
        if delta.content:
            events += self._text_into("text", delta.content)
        for call in delta.tool_calls:
            if call.id is not None:  # a new call: its first delta carries id and name
                events += self._open({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
                                      "input": {}})
            if call.arguments:
                self.arguments += call.arguments
                events.append(self.event("content_block_delta", index=len(self.blocks) - 1,
                                         delta={"type": "input_json_delta", "partial_json": call.arguments}))
        return events

    def close(self) -> list[dict[str, str]]:
        """End the open block, if any; a tool_use block gets its input parsed."""
        block, self.open, self.held = self.open, None, ""
        if block is None:
            return []
        if block["type"] == "tool_use":
            block["input"] = parsed_input(self.arguments)
        return [self.event("content_block_stop", index=len(self.blocks) - 1)]

    def _text_into(self, kind: str, text: str) -> list[dict[str, str]]:
        field = "thinking" if kind == "thinking" else "text"
        if self.open is None or self.open["type"] != kind:
            if kind == "text" and not (self.held + text).strip():  # maybe only the whitespace before a call
                self.held += text
                return []
            text, self.held = self.held + text, ""
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                                                                           "signature": ""}
            events = self._open(block)
        else:
            events = []
        self.open[field] += text
        return events + [self.event("content_block_delta", index=len(self.blocks) - 1,
                                    delta={"type": f"{field}_delta", field: text})]

    def _open(self, block: dict[str, Any]) -> list[dict[str, str]]:
        events = self.close()
        self.blocks.append(block)
        self.open, self.arguments = block, ""
        return events + [self.event("content_block_start", index=len(self.blocks) - 1, content_block=dict(block))]


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")  # Anthropic's spelling of the same id


def parsed_input(arguments: str) -> dict[str, Any]:
    """The call's arguments as the `input` object; {} when max_tokens cut them short (stop_reason says so)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
