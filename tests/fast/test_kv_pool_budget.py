"""DECODE_STEP=compiled keeps KV memory within KV_CACHE_BYTES: its pool is charged to the same budget that admission
reads. The pooled step runs uncompiled here (the same arithmetic, app/core/runner/static_step.py), so this stays
in the fast lane; the compiled step's own tests are in test_static_step.py."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools

import pytest

import app.core.engine.engine as engine_module
from app.core.engine.engine import Engine
from app.core.engine.kv_budget import KVBudget, KVLayout
from app.core.runner.static_step import build_decode_step
from app.core.sampling import SamplingParams
from app.errors import InvalidRequest
from engine_runs import run_engine

PROMPTS = ["The capital of France", "def reverse(s):", "Emoji are fun: "]


@pytest.fixture
def pooled_uncompiled(monkeypatch):
    monkeypatch.setattr(engine_module, "build_decode_step", functools.partial(build_decode_step, compile=False))


def test_the_pool_is_charged_to_the_budget_and_kv_never_exceeds_it(tiny_lm, tiny_tokenizer, pooled_uncompiled,
                                                                     monkeypatch):
    layout = KVLayout.from_config(tiny_lm.model.config, tiny_lm.dtype)
    capacity = layout.bytes_for(400)
    peaks = []
    real_reserve = KVBudget.reserve

    def reserve(self, owner, nbytes):
        ok = real_reserve(self, owner, nbytes)
        peaks.append(self.in_use)
        return ok

    monkeypatch.setattr(KVBudget, "reserve", reserve)
    requests = [(tiny_tokenizer.encode(p), SamplingParams(max_tokens=40, do_sample=False, ignore_eos=True))
                for p in PROMPTS]
    settings = dict(together=True, max_active=3, kv_cache_bytes=capacity, prefix_cache_bytes=0, speculative="off")
    eager, _ = run_engine(dataclasses.replace(tiny_lm, model=copy.deepcopy(tiny_lm.model)), requests, **settings)
    pooled, engine = run_engine(dataclasses.replace(tiny_lm, model=copy.deepcopy(tiny_lm.model)), requests,
                                decode_step="compiled", **settings)
    pool = engine._runner.static_decode.pool
    assert engine.kv_budget.set_aside_bytes == pool.nbytes and 0 < pool.nbytes <= capacity // 2
    assert max(peaks) <= capacity  # the pool and every request's reservation, together
    assert [s.tokens for s in pooled] == [s.tokens for s in eager]
    assert engine._runner.static_decode.steps > 10  # the pool did decode


def test_a_request_that_fits_the_budget_but_not_beside_the_pool_is_refused(tiny_lm, tiny_tokenizer,
                                                                            pooled_uncompiled):
    layout = KVLayout.from_config(tiny_lm.model.config, tiny_lm.dtype)
    engine = Engine(dataclasses.replace(tiny_lm, model=copy.deepcopy(tiny_lm.model)), kv_cache_bytes=layout.bytes_for(200),
                    decode_step="compiled", prefix_cache_bytes=0)

    async def main():
        engine.start()
        await asyncio.to_thread(engine.loaded.wait)
        try:
            prompt = tiny_tokenizer.encode("hello")
            with pytest.raises(InvalidRequest) as refused:  # it alone fits 200 tokens, not the half left
                engine.submit(prompt, SamplingParams(max_tokens=150, do_sample=False))
            handle = engine.submit(prompt, SamplingParams(max_tokens=20, do_sample=False))
            return refused.value, [event async for event in handle]
        finally:
            engine.stop()

    refused, events = asyncio.run(main())
    assert refused.code == "kv_cache_exceeded" and refused.param == "max_tokens"
    assert len(events) == 20 and events[-1].finish_reason == "length"
