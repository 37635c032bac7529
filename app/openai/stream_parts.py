"""The parts of an answer around its tokens, shared by the wire formats: tool-call chunk payloads, the events of
several choices merged in arrival order, the `x-sampling-params` header, `usage`, and the timings the access log
line reports."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from fastapi import Request

from app.core.sampling import SamplingParams
from app.core.sequence import TokenEvent
from app.errors import ServeError
from app.openai.answer import Choice, Delta


def tool_payloads(index: int, delta: Delta, logprobs: list | None) -> list[dict[str, Any]]:
    """A delta with tool calls as chunk choices: its content (if any), then each call delta; the first carries
    the token's logprobs and inspection, the last its finish reason."""
    deltas = ([{"content": delta.content}] if delta.content else []) + [{"tool_calls": [d.wire()]}
                                                                      for d in delta.tool_calls]
    payloads = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
    if logprobs:
        payloads[0]["logprobs"] = {"content": logprobs}
    if delta.inspect is not None:
        payloads[0]["inspect"] = delta.inspect
    payloads[-1]["finish_reason"] = delta.finish_reason
    return payloads


async def merge_events(choices: list[Choice]) -> AsyncIterator[tuple[Choice, TokenEvent]]:
    """Interleave the events of several choices (n > 1) in arrival order."""
    if len(choices) == 1:
        async for event in choices[0].handle:
            yield choices[0], event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for event in choice.handle:
                await queue.put((choice, event))
        except ServeError as err:
            await queue.put(err)
        await queue.put(None)

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        remaining = len(choices)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, ServeError):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


def sampling_header(params: SamplingParams) -> str:
    """The effective settings for the `x-sampling-params` header, with lists (stop strings, stop ids, logit_bias)
    counted instead of listed: echoed whole they can pass 16 KiB, which httpx, the openai SDK and proxies reject."""
    effective = {name: len(value) if isinstance(value, (list, tuple, dict)) else value
                 for name, value in params.effective().items()}
    return json.dumps(effective, ensure_ascii=True, default=str)


def record_timing(request: Request, choices: list[Choice]) -> None:
    """For the access log line."""
    request.state.completion_tokens = sum(c.tokens for c in choices)
    request.state.finish_reasons = [c.finish_reason for c in choices]
    first = choices[0].handle
    if first.first_token_at is not None:
        request.state.ttft_s = first.first_token_at - first.submitted_at


def usage(prompt_tokens: int, completion_tokens: int, choices: list[Choice]) -> dict[str, Any]:
    # The prompt is counted once for all choices (as OpenAI does), so are its tokens read from the prefix cache.
    cached = max(c.handle.cached_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
