"""DeepSeek-V3's multi-head latent attention (MLA) in our packed path: its cache holds a compressed latent and a
shared rotary key per token (not keys and values per head), which the model expands into keys and values of
different sizes after reading the cache. Batched, chunked, prefix-cached and pooled-step runs give
`model.generate()`'s greedy tokens, and the KV budget, the prefix cache and the KV pool count the latent's size, not
a head's."""

from __future__ import annotations

import pytest
import torch

from app.core.engine.kv_budget import KVLayout
from app.core.runner.kv_pool import KVPool, kv_shape
from app.core.runner.static_step import build_decode_step
from app.core.sampling import SamplingParams
from app.models.loading import LoadedModel
from arch_models import build
from engine_runs import run_engine

TEXTS = ("The capital of France is Paris. Paris is a city on the Seine.", "def reverse(s):\n    return s[::-1]",
         "北京是中国的首都。上海是一个大城市。")
N = 10


@pytest.fixture(scope="module")
def mla(tiny_tokenizer):
    model = build("deepseek_v3", len(tiny_tokenizer))
    prompts = [tiny_tokenizer.encode(text) for text in TEXTS]
    expected = [model.generate(torch.tensor([p]), max_new_tokens=N, min_new_tokens=N, do_sample=False)[0, len(p):]
                .tolist() for p in prompts]
    lm = LoadedModel(model=model, tokenizer=tiny_tokenizer, name="mla", max_context=256, eos_ids=())
    return lm, prompts, expected


GREEDY = SamplingParams(max_tokens=N, do_sample=False, ignore_eos=True)


def test_batched_requests_give_generates_tokens(mla):
    """Before: every request of a packed pass failed with AttributeError: 'PerRequest' object has no attribute
    'shape' (the model expands the cached latents itself, after the cache returns them)."""
    lm, prompts, expected = mla
    seen, engine = run_engine(lm, [(p, GREEDY) for p in prompts], together=True)
    assert engine.batch_decode
    assert [s.tokens for s in seen] == expected
    assert [s.finish_reason for s in seen] == ["length"] * len(prompts)


def test_chunked_prefill_beside_decoding_rows_gives_generates_tokens(mla):
    lm, prompts, expected = mla
    seen, _ = run_engine(lm, [(p, GREEDY) for p in prompts], together=True, prefill_tokens_per_step=5)
    assert [s.tokens for s in seen] == expected


def test_a_warm_prefix_cache_is_hit_and_gives_generates_tokens(mla):
    """Before: the insert failed (the latent and the rotary key are of different sizes), so nothing was cached."""
    lm, prompts, expected = mla
    seen, engine = run_engine(lm, [(prompts[0], GREEDY)] * 2, prefix_cache_bytes=1 << 22)
    assert len(engine.prefix_cache) > 0
    assert seen[1].cached_tokens == 16 and [s.tokens for s in seen] == [expected[0]] * 2


def test_the_kv_budget_counts_the_latent_not_per_head_keys(mla):
    """kv_lora_rank 32 + rotary 16 per token and layer in fp32, where per-head keys and values would be
    2 x 4 heads x 16 (the rotary head_dim the config gives)."""
    lm, *_ = mla
    assert KVLayout.from_config(lm.model.config, torch.float32).bytes_per_token == 2 * (32 + 16) * 4
    assert kv_shape(lm.model.config) == (2, 1, 32, 16)
    pool = KVPool(lm.model.config, num_blocks=2, block_size=4, dtype=torch.float32, device="cpu")
    assert pool.keys[0].shape == (3, 1, 4, 32) and pool.values[0].shape == (3, 1, 4, 16)
    assert pool.nbytes == 3 * KVPool.bytes_per_block(lm.model.config, 4, torch.float32)


def test_the_pooled_decode_step_expands_the_pools_latents_and_gives_generates_tokens(mla, monkeypatch):
    """DECODE_STEP=compiled's step, here without inductor: the pool holds the latents, the model expands every row's
    own, and attention reads them under the step's mask."""
    import functools

    import app.core.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "build_decode_step", functools.partial(build_decode_step, compile=False))
    lm, prompts, expected = mla
    seen, engine = run_engine(lm, [(p, GREEDY) for p in prompts], together=True, decode_step="compiled")
    assert engine._runner.static_decode.steps >= N - 2  # every decode-only step after the prefills
    assert [s.tokens for s in seen] == expected
