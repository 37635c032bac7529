"""DECODE_STEP=compiled with LoRA adapters: the compiled step is traced without adapters, so a pass with an
adapter row runs eagerly (its pooled rows first make room) and passes of the base alone still take the step. The
adapter's tokens stay peft's merged model's; the base's stay the eager engine's."""

from __future__ import annotations

import asyncio

import pytest
import torch

from app.core.engine.engine import Engine
from app.core.sampling import SamplingParams
from app.models.lora import LoraAdapters
from test_lora import PROMPTS, adapters, fresh_lm, reference  # noqa: F401 - `adapters` is a fixture

pytestmark = pytest.mark.compile


def test_adapter_rows_run_eagerly_beside_the_compiled_step(tiny_tokenizer, adapters):  # noqa: F811
    torch._dynamo.reset()
    paths, merged = adapters
    lm = fresh_lm(tiny_tokenizer)
    base_model = fresh_lm(tiny_tokenizer).model  # the same weights, never wrapped: the base's oracle
    engine = Engine(lm, adapters=LoraAdapters("tiny", paths), decode_step="compiled", speculative="off",
                    max_active=4)
    runs = [(PROMPTS[0], None, 24), (PROMPTS[1], None, 24), (PROMPTS[2], "alpha", 6)]

    async def one(text, name, n):
        handle = engine.submit(lm.encode_text(text), SamplingParams(max_tokens=n, do_sample=False),
                               adapter=engine.adapters.get(name) if name else None)
        return [event.token_id async for event in handle]

    async def main():
        engine.start()
        await asyncio.to_thread(engine.loaded.wait)
        if engine.load_error is not None:
            raise engine.load_error
        try:
            return await asyncio.gather(*(one(*run) for run in runs))
        finally:
            engine.stop()

    tokens = asyncio.run(main())
    assert tokens[2] == reference(merged["alpha"], lm.encode_text(PROMPTS[2]), 6)
    for got, (text, _, n) in zip(tokens[:2], runs):
        assert got == reference(base_model, lm.encode_text(text), n)
    assert engine._runner.static_decode.steps > 0  # once the adapter's request ended, the base's took the step
