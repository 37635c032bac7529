"""Chat completions and text completions on the wire: their requests prepared, their answers written as the exact
shapes the openai SDK expects (`chat.completion` and its chunks, `text_completion`), over the shared flow
(app/openai/flow.py). A stream ends with `data: [DONE]`, after a failure too.

Prompt scores (`echo` with `logprobs`, `prompt_logprobs`; app/openai/scoring.py) come from the one choice that
scored the prompt, the first: a stream holds its siblings' chunks back until those scores are laid out, so every
choice's first chunk carries them, and the chunks that carry them are written as JSON on a prepare worker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from app.errors import InvalidRequest, ServeError
from app.openai.answer import Choice, Delta
from app.openai.flow import Prepared, WireApi
from app.openai.protocol import ChatCompletionRequest, CompletionRequest, new_id, now
from app.openai.scoring import Echo, json_text
from app.openai.sse import encoded_event
from app.openai.stream_parts import tool_payloads, usage


def error_body(err: ServeError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.error_type, "param": err.param, "code": err.code}}


@dataclass
class Answer:
    """One chat or text completion being written."""

    id: str
    object: str  # "chat.completion" or "text_completion"
    chat: bool
    model: str
    prompt_tokens: int
    echo: Echo
    include_usage: bool
    created: int = field(default_factory=now)


class ChatApi(WireApi):
    async def prepare(self, body: ChatCompletionRequest) -> Prepared:
        return await self.serving.prepare_chat(body)

    def answer(self, body, prepared: Prepared, choices: list[Choice], request: Request) -> Answer:
        kind = ("chatcmpl", "chat.completion") if prepared.chat else ("cmpl", "text_completion")
        echo = Echo.of(body, prepared.prompt, prepared.prompt_ids, self.serving.lm.tokenizer, prepared.chat)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Answer(new_id(kind[0], getattr(request.state, "x_request_id", None)), kind[1], prepared.chat,
                      self.serving.served_name(choices), len(prepared.prompt_ids), echo, include_usage)

    def error_event(self, answer: Answer, err: ServeError) -> dict[str, str]:
        return {"data": json.dumps(error_body(err))}

    async def lay_out_scores(self, answer: Answer, choices: list[Choice]) -> None:
        """The prompt's scores, from the choice that scored it, laid out once on a prepare worker."""
        if answer.echo.asked and not answer.echo.laid_out:
            await self.serving.off_loop(answer.echo.lay_out, self.serving.lm.tokenizer, choices[0].prompt_logprobs)

    # ---- one JSON body ----

    async def whole(self, answer: Answer, choices: list[Choice], headers: dict[str, str]) -> Response:
        if not answer.echo.asked:
            return Response(json_text(self.body(answer, choices), depth=0), media_type="application/json",
                            headers=headers)
        await self.lay_out_scores(answer, choices)
        written = await self.serving.off_loop(lambda: json_text(self.body(answer, choices)).encode())
        return Response(written, media_type="application/json", headers=headers)  # bytes: sent as they are

    def body(self, answer: Answer, choices: list[Choice]) -> dict[str, Any]:
        echo = answer.echo
        completion_tokens = 0 if echo.score_only else sum(c.tokens for c in choices)
        out_choices = []
        for c in choices:
            item: dict[str, Any] = {"index": c.index, "finish_reason": echo.finish_reason(c.finish_reason)}
            if answer.chat:
                item["message"] = c.message()
                item["logprobs"] = {"content": c.logprobs} if c.handle.params.logprobs else None
            else:
                item["text"], item["logprobs"] = echo.text_and_logprobs(c, "".join(c.text), c.logprobs)
                if echo.vllm:
                    item["prompt_logprobs"] = echo.vllm_scores()
            if c.handle.params.inspect:
                item["inspect"] = c.inspect
            out_choices.append(item)
        out = {"id": answer.id, "object": answer.object, "created": answer.created, "model": answer.model,
               "system_fingerprint": self.serving.fingerprint, "choices": out_choices,
               "usage": usage(answer.prompt_tokens, completion_tokens, choices)}
        if answer.chat and echo.vllm:  # vLLM puts a chat prompt's at the top
            out["prompt_logprobs"] = echo.vllm_scores()
        return out

    # ---- a stream ----

    def chunk(self, answer: Answer, payload_choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": answer.id, "object": answer.object + ".chunk" if answer.chat else answer.object,
                "created": answer.created, "model": answer.model, "system_fingerprint": self.serving.fingerprint,
                "choices": payload_choices, **extra}

    async def events(self, answer: Answer, choices: list[Choice], request: Request) -> AsyncIterator[dict[str, str]]:
        if answer.chat:
            for c in choices:
                yield self.sse(self.chunk(answer, [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]))
        first = {c.index for c in choices}  # choices whose first delta is still to come (it carries the prompt's)
        held: list[tuple[Choice, Delta]] = []  # deltas waiting for the prompt's scores
        async for c, delta in self.serving.deltas(choices):
            held.append((c, delta))
            if answer.echo.asked and not answer.echo.laid_out:
                if not first_event_came(choices[0]):
                    continue
                await self.lay_out_scores(answer, choices)
            for c, delta in held:
                if c.index in first and answer.echo.asked:  # it carries the prompt's scores: written off the loop
                    for event in await self.serving.off_loop(self.written, answer, c, delta):
                        yield event
                else:
                    for chunk in self.delta_chunks(answer, c, delta, c.index in first):
                        yield self.sse(chunk)
                first.discard(c.index)
            held.clear()
        if answer.include_usage:
            completion_tokens = 0 if answer.echo.score_only else sum(c.tokens for c in choices)
            yield self.sse(self.chunk(answer, [], usage=usage(answer.prompt_tokens, completion_tokens, choices)))

    def delta_chunks(self, answer: Answer, c: Choice, delta: Delta, first: bool) -> list[dict[str, Any]]:
        echo = answer.echo
        logprobs = [delta.logprobs] if delta.logprobs is not None else None
        if not answer.chat:
            text, legacy = echo.text_and_logprobs(c, delta.content, logprobs or [], first)
            payload = {"index": c.index, "text": text, "logprobs": legacy,
                       "finish_reason": echo.finish_reason(delta.finish_reason)}
            if first and echo.vllm:
                payload["prompt_logprobs"] = echo.vllm_scores()
            if delta.inspect is not None:
                payload["inspect"] = delta.inspect
            return [self.chunk(answer, [payload])]
        chunks = []
        if first and c.index == 0 and echo.vllm:  # once for the request, as at the top of a whole answer
            chunks.append(self.chunk(answer, [], prompt_logprobs=echo.vllm_scores()))
        if delta.reasoning:  # the thinking goes out first, in a chunk of its own
            chunks.append(self.chunk(answer, [{"index": c.index, "logprobs": None, "finish_reason": None, "delta": {
                "reasoning_content": delta.reasoning, "reasoning": delta.reasoning}}]))
            if not (delta.content or logprobs or delta.finish_reason or delta.inspect):
                return chunks
        if delta.tool_calls:  # content first, then one chunk per call delta
            return chunks + [self.chunk(answer, [p]) for p in tool_payloads(c.index, delta, logprobs)]
        payload = {"index": c.index, "delta": {"content": delta.content} if delta.content else {},
                   "logprobs": {"content": logprobs} if logprobs else None, "finish_reason": delta.finish_reason}
        if delta.inspect is not None:
            payload["inspect"] = delta.inspect
        return chunks + [self.chunk(answer, [payload])]

    def written(self, answer: Answer, c: Choice, delta: Delta) -> list[bytes]:
        """A choice's first chunks, which carry the prompt's scores, made and written as SSE events (on a prepare
        worker)."""
        return [encoded_event(json_text(chunk)) for chunk in self.delta_chunks(answer, c, delta, True)]

    @staticmethod
    def sse(chunk: dict[str, Any]) -> dict[str, str]:
        return {"data": json.dumps(chunk, ensure_ascii=False)}


class CompletionsApi(ChatApi):
    async def prepare(self, body: CompletionRequest) -> Prepared:
        prompt = body.prompt_value()
        serving = self.serving
        prompt_ids = await serving.encode_text(prompt) if isinstance(prompt, str) else serving.check_prompt_ids(prompt)
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        return Prepared(body, prompt_ids, chat=False, prompt=prompt)


def first_event_came(choice: Choice) -> bool:
    """The choice's first event has come (it carries the prompt's scores, or a deadline ended it without)."""
    return choice.prompt_logprobs is not None or choice.tokens > 0 or choice.finish_reason is not None
