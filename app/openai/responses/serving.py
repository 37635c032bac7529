"""The Responses API (`POST /v1/responses`), stateless: the chat completions path underneath, another wire shape on top.

The request becomes the chat request it means (protocol.py) and goes through the shared flow (app/openai/flow.py):
the same template, sampling parameters, engine, reasoning split and tool-call parsers, and the same stream loop.
What differs is how the answer is written (`ResponsesApi`):
- the answer is a list of output items: `reasoning` (a reasoning model's thinking), `message` (its `output_text`),
  and one `function_call` (`call_id`, `name`, `arguments`) per tool call;
- `status` is "completed", or "incomplete" with `incomplete_details.reason: "max_output_tokens"`;
- `usage` counts `input_tokens` and `output_tokens` (and the reasoning tokens among them);
- a stream is a sequence of typed events, each with a `sequence_number`: `response.created`,
  `response.in_progress`, then for each item `response.output_item.added`, its parts and deltas
  (`response.content_part.added`, `response.output_text.delta` / `.done`, `response.reasoning_text.delta` /
  `.done`, `response.function_call_arguments.delta` / `.done`), `response.output_item.done`, and at the end
  `response.completed` (or `response.incomplete`), and no `[DONE]`. A failure after the 200 sends an `error`
  event, then `[DONE]` (OpenAI's own stream ends so after an error).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from app.errors import InvalidRequest, ServeError
from app.openai.answer import Choice, Delta, choice_calls
from app.openai.flow import FAILED, Prepared, WireApi, create
from app.openai.protocol import ChatCompletionRequest, now
from app.openai.responses.protocol import CHAT_TO_RESPONSES_PARAM, ResponsesRequest
from app.openai.serving import CompletionServing


class ResponsesServing:
    """The route's entry point (app/api.py)."""

    def __init__(self, serving: CompletionServing):
        self.serving = serving

    async def create(self, body: ResponsesRequest, request: Request):
        return await create(ResponsesApi(self.serving), body, request)


class ResponsesApi(WireApi):
    done_after = frozenset({FAILED})  # a finished stream ends with response.completed (or .incomplete) alone
    param_names = CHAT_TO_RESPONSES_PARAM

    async def prepare(self, body: ResponsesRequest) -> Prepared:
        chat = await self.serving.preparing.run(body.to_chat_request)  # validates the chat request: not on the loop
        check_echo(body)  # before anything runs: afterwards, the answer would have nowhere to go
        return await self.serving.prepare_chat(chat)

    def answer(self, body: ResponsesRequest, prepared: Prepared, choices: list[Choice], request: Request) -> Answer:
        answer = Answer(body, prepared.request, self.serving.served_name(choices), len(prepared.prompt_ids))
        if rid := getattr(request.state, "x_request_id", None):
            answer.id = f"resp_{rid}"  # the request's x-request-id, as on the other routes
        return answer

    async def events(self, answer: Answer, choices: list[Choice], request: Request) -> AsyncIterator[dict]:
        for event in answer.start_events():
            yield event
        async for _, delta in self.serving.deltas(choices):
            for event in answer.delta_events(delta, choices[0]):
                yield event

    def error_event(self, answer: Answer, err: ServeError) -> dict[str, str]:  # OpenAI's shape for a stream
        return answer.event("error", code=err.code or err.error_type, message=err.message, param=err.param)

    async def whole(self, answer: Answer, choices: list[Choice], headers: dict[str, str]) -> JSONResponse:
        answer.add_whole(choices[0])
        return JSONResponse(answer.response("done"), headers=headers)


class Answer:
    """One response being written: its output items so far, and the events that announce them."""

    def __init__(self, body: ResponsesRequest, chat: ChatCompletionRequest, model_id: str, input_tokens: int):
        self.id = item_id("resp")
        self.created_at = now()
        self.body, self.chat, self.model_id = body, chat, model_id
        self.input_tokens = input_tokens
        self.items: list[dict[str, Any]] = []  # output items, in order
        self.open: dict[str, Any] | None = None  # the item still receiving deltas (the last one), if any
        self.sequence = 0
        self.choice: Choice | None = None

    # ---- the response object ----

    def response(self, stage: str) -> dict[str, Any]:
        """stage: "created" (no output yet) or "done" (final status, output and usage)."""
        b = self.body
        done = stage == "done"
        # cut short by max_output_tokens, or by a deadline (docs/operations.md): incomplete, saying which
        incomplete = done and self.choice is not None and self.choice.finish_reason in ("length", "timeout")
        why = "timeout" if incomplete and self.choice.finish_reason == "timeout" else "max_output_tokens"
        status = ("incomplete" if incomplete else "completed") if done else "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model_id, "output": self.items if done else [],
            "error": None, "incomplete_details": {"reason": why} if incomplete else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": (b.reasoning or {}).get("effort"), "summary": None},
            "store": False, "temperature": b.temperature, "top_p": b.top_p,
            "text": {"format": b.text.format.model_dump(by_alias=True, exclude_none=True)
                     if b.text and b.text.format else {"type": "text"}},
            "tool_choice": b.tool_choice or "auto", "tools": b.tools or [], "truncation": "disabled",
            "metadata": b.metadata or {}, "user": (b.model_extra or {}).get("user"),
            "usage": self.usage() if done else None,
        }

    def usage(self) -> dict[str, Any]:
        output = self.choice.tokens if self.choice else 0
        reasoning = self.choice.reasoning_tokens if self.choice else 0
        cached = self.choice.handle.cached_tokens if self.choice else 0  # read from the prefix cache
        return {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": output, "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": self.input_tokens + output}

    def add_whole(self, choice: Choice) -> None:
        """A non-streamed answer: its deltas replayed through the same item logic, without events."""
        self.delta_events(Delta("".join(choice.reasoning), "".join(choice.text), finish_reason=choice.finish_reason,
                                tool_calls=choice_calls(choice)), choice)

    # ---- events ----

    def event(self, kind: str, **fields: Any) -> dict[str, str]:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return {"event": kind, "data": json.dumps(payload, ensure_ascii=False, allow_nan=False)}  # check_echo

    def start_events(self) -> list[dict[str, str]]:
        return [self.event("response.created", response=self.response("created")),
                self.event("response.in_progress", response=self.response("created"))]

    def delta_events(self, delta: Delta, choice: Choice) -> list[dict[str, str]]:
        """Events for one delta: thinking, then answer text, then tool calls, each in its own output item."""
        self.choice = choice
        events: list[dict[str, str]] = []
        if delta.reasoning:
            events += self._text_into("reasoning", delta.reasoning)
        if delta.content:
            events += self._text_into("message", delta.content)
        for call in delta.tool_calls:
            if call.id is not None:  # a new call: its first delta carries id and name
                events += self._close()
                item = {"type": "function_call", "id": item_id("fc"), "call_id": call.id, "name": call.name,
                        "arguments": "", "status": "in_progress"}
                events += self._open(item)
            if call.arguments:
                self.open["arguments"] += call.arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                         output_index=len(self.items) - 1, delta=call.arguments))
        if delta.finish_reason is not None:
            if not self.items:  # nothing at all was said: still one (empty) message, as OpenAI answers
                events += self._open(self._new_item("message"))
            events += self._close()
            final = self.response("done")
            events.append(self.event(f"response.{final['status']}", response=final))
        return events

    def _text_into(self, kind: str, text: str) -> list[dict[str, str]]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            events += self._open(self._new_item(kind))
        part = self.open["content"][0]
        part["text"] += text
        where = {"item_id": self.open["id"], "output_index": len(self.items) - 1, "content_index": 0}
        delta_kind = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [self.event(delta_kind, **where, delta=text, **extra)]

    def _new_item(self, kind: str) -> dict[str, Any]:
        if kind == "message":
            return {"type": "message", "id": item_id("msg"), "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        return {"type": "reasoning", "id": item_id("rs"), "summary": [], "status": "in_progress",
                "content": [{"type": "reasoning_text", "text": ""}]}

    def _open(self, item: dict[str, Any]) -> list[dict[str, str]]:
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        announced = {**item, "content": []} if "content" in item else dict(item)
        events = [self.event("response.output_item.added", output_index=index, item=announced)]
        if item["type"] in ("message", "reasoning"):
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part={**item["content"][0], "text": ""}))
        return events

    def _close(self) -> list[dict[str, str]]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items) - 1
        cut = self.choice is not None and self.choice.finish_reason in ("length", "timeout")
        item["status"] = "incomplete" if cut else "completed"
        where = {"item_id": item["id"], "output_index": index}
        events = []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                     arguments=item["arguments"]))
        else:
            part = item["content"][0]
            done_kind = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events.append(self.event(done_kind, **where, content_index=0, text=part["text"], **extra))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        return events + [self.event("response.output_item.done", output_index=index, item=item)]


def check_echo(body: ResponsesRequest) -> None:
    """The response object repeats fields as the client sent them (`text`, `tools`, `metadata`...): each must be
    strict JSON, or the answer could not be written once its generation has run (a 500), and a stream's
    `response.created` would carry a bare `NaN`, which strict JSON parsers refuse. A 400 naming the field instead."""
    for name, value in Answer(body, None, "", 0).response("created").items():
        try:
            json.dumps(value, allow_nan=False)
        except RecursionError as err:
            raise InvalidRequest(f"`{name}` is nested too deeply to be repeated in the response",
                                 param=name) from err
        except (ValueError, TypeError) as err:  # NaN or Infinity
            raise InvalidRequest(f"`{name}` cannot be repeated in the response as JSON: {err}", param=name) from err


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"  # OpenAI's spelling: resp_..., msg_..., rs_..., fc_...
