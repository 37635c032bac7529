"""The KV store (app/core/runner/kv_store.py): a request's cache grows in place, by doubling, and the tokens it gives
are still exactly model.generate()'s in fp32, alone and packed among requests of other lengths."""

from __future__ import annotations

import math

import pytest
import torch

from app.core.runner.kv_store import MIN_CAPACITY, GrowingLayer, KVStore
from app.core.sampling import SamplingParams
from app.core.sequence import Sequence

from test_batching import batched, hf_greedy, solo


def test_appending_in_place_keeps_earlier_views_and_reallocates_log_n_times():
    layer, n = GrowingLayer(), 3000
    tokens = torch.randn(1, 2, n, 8)  # [1, kv_heads, n, d]
    keys, _ = layer.update(tokens[:, :, :5], -tokens[:, :, :5])  # a prefill of 5
    first = keys  # a view handed out before any later append
    storage = layer.keys.data_ptr()
    for t in range(5, n):  # then one decode token at a time
        keys, values = layer.update(tokens[:, :, t : t + 1], -tokens[:, :, t : t + 1])
        if t < MIN_CAPACITY:
            assert keys.data_ptr() == storage  # written in place: no new tensor while there is room
    assert torch.equal(first, tokens[:, :, :5])  # the earlier view still holds what it held
    assert torch.equal(keys, tokens) and torch.equal(values, -tokens) and keys.shape == (1, 2, n, 8)
    assert layer.get_seq_length() == n
    assert layer.grows == 1 + math.ceil(math.log2(n / MIN_CAPACITY))  # 256, 512, ..., 4096: O(log n)


def test_a_crop_drops_the_last_tokens_and_the_next_ones_are_written_over_them():
    layer = GrowingLayer()
    tokens = torch.randn(1, 2, 10, 4)
    layer.update(tokens, tokens)
    layer.crop(-3)  # as speculation drops rejected drafts
    assert layer.get_seq_length() == 7 and torch.equal(layer.keys, tokens[:, :, :7])
    new = torch.randn(1, 2, 1, 4)
    keys, _ = layer.update(new, new)
    assert torch.equal(keys, torch.cat([tokens[:, :, :7], new], dim=2)) and layer.grows == 1
    with pytest.raises(ValueError):
        layer.crop(2)


def test_storage_never_grows_past_the_requests_limit():
    layer = GrowingLayer(limit=300)
    for _ in range(300):
        layer.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))
    assert layer.capacity == 300 and layer.grows == 2  # 256, then 300 (not 512)


def test_every_full_attention_layer_of_a_requests_cache_is_a_growing_one(tiny_lm):
    seq = Sequence(tiny_lm.model, tiny_lm.tokenizer, [1, 2, 3], SamplingParams(max_tokens=5), tiny_lm.eos_ids,
                   tiny_lm.max_context)
    assert isinstance(seq.cache, KVStore)
    assert all(isinstance(layer, GrowingLayer) and layer.limit == 8 for layer in seq.cache.layers)


def test_greedy_tokens_equal_model_generate_in_fp32_alone(tiny_lm):
    ids = tiny_lm.encode_text("The store grows in place, and the tokens stay the same.")
    params = SamplingParams(max_tokens=40, do_sample=False, ignore_eos=True)
    assert solo(tiny_lm, ids, params) == hf_greedy(tiny_lm, ids, 40)


def test_greedy_tokens_equal_model_generate_in_fp32_amid_requests_of_other_lengths(tiny_lm):
    texts = ["Hi", "A somewhat longer prompt, to mix the lengths", "x " * 40]
    prompts = [tiny_lm.encode_text(t) for t in texts]
    params = [SamplingParams(max_tokens=30 - 5 * i, do_sample=False, ignore_eos=True) for i in range(len(texts))]
    got = batched(tiny_lm, prompts, params, chunk=8)  # prefill chunks and decode rows share passes
    assert got == [hf_greedy(tiny_lm, ids, p.max_tokens) for ids, p in zip(prompts, params)]


def test_bf16_decode_rows_over_their_own_keys_give_the_padded_calls_tokens(tiny_lm, monkeypatch):
    """On a CPU in bf16, long rows attend each over its own keys where they lie, short ones in one padded call
    (`PAD_UP_TO`); the two are the same fp32 arithmetic on the same bf16 keys, so greedy tokens agree."""
    from app.core.runner import packed
    from app.models.loading import LoadedModel

    from conftest import build_tiny_model

    lm = LoadedModel(model=build_tiny_model(tiny_lm.vocab_size).to(torch.bfloat16), tokenizer=tiny_lm.tokenizer,
                     name="tiny-bf16", max_context=256, eos_ids=tiny_lm.eos_ids)
    prompts = [lm.encode_text(t) for t in ("Hi", "A somewhat longer prompt, to mix the lengths", "x " * 40)]
    params = [SamplingParams(max_tokens=20, do_sample=False, ignore_eos=True)] * len(prompts)
    monkeypatch.setattr(packed, "PAD_UP_TO", 10**6)
    padded = batched(lm, prompts, params, chunk=8)
    monkeypatch.setattr(packed, "PAD_UP_TO", 0)
    assert batched(lm, prompts, params, chunk=8) == padded
