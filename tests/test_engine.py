"""The engine's scheduler, driven directly (no HTTP): a burst of new requests takes turns at prefill, so the
first arrivals start streaming while later prompts are still being read."""

from __future__ import annotations

import asyncio

import torch

from app.core.engine import Engine, default_prefill_tokens_per_step
from app.core.sampling import SamplingParams


class RecordingEngine(Engine):
    """Notes which request each token event was emitted for, in the worker's own order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.emitted: list[str] = []

    def _emit(self, handle, event):
        self.emitted.append(handle.request_id)
        super()._emit(handle, event)


async def tokens_before_first(lm, prefill_tokens_per_step: int, prompts: list[list[int]]) -> list[list[int]]:
    """Submit all prompts at once; for each request, how many tokens every request had been sent when its
    first token was emitted."""
    engine = RecordingEngine(lm, max_active=8, prefill_tokens_per_step=prefill_tokens_per_step)
    engine.start()
    await asyncio.to_thread(engine.loaded.wait)
    params = SamplingParams(max_tokens=12, do_sample=False, ignore_eos=True)
    handles = [engine.submit(ids, params, request_id=str(i)) for i, ids in enumerate(prompts)]

    async def consume(handle) -> int:
        return sum([1 async for _ in handle])

    try:
        assert await asyncio.gather(*(consume(h) for h in handles)) == [12] * len(prompts)
    finally:
        engine.stop()
    ids = [str(i) for i in range(len(prompts))]
    firsts = [engine.emitted.index(i) for i in ids]
    return [[engine.emitted[:first].count(j) for j in ids] for first in firsts]


def test_a_burst_takes_turns_at_prefill(tiny_lm):
    prompts = [tiny_lm.encode_text(f"Request {i}: tell me about Paris, the Seine and its many bridges.")
               for i in range(4)]
    assert all(len(p) > 16 for p in prompts)
    # 16 prompt tokens per step: each prompt needs two or more steps, so the first request is streaming
    # before the last one's prefill is done.
    small = asyncio.run(tokens_before_first(tiny_lm, 16, prompts))
    assert small[-1][0] >= 3, small
    # With room for every prompt in one step, all first tokens come out of that same step.
    big = asyncio.run(tokens_before_first(tiny_lm, 4096, prompts))
    assert all(sum(before) <= len(prompts) - 1 for before in big), big


def test_default_prefill_budget_is_small_on_cpu_and_large_on_gpu():
    assert default_prefill_tokens_per_step(torch.device("cpu")) == 128
    assert default_prefill_tokens_per_step(torch.device("cuda")) == 2048
