"""KV_CACHE_DTYPE=int8 (app/core/runner/kv_store.py's Int8Layer): 0.64x bf16's KV bytes, what it rounds and how far, and
that it keeps the server's promises: a prefix cache hit equals the cold run, BATCH_INVARIANT still holds, the KV
budget admits the tokens it saves, and the settings it cannot serve are refused at start."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from app.config import Settings
from app.core.engine.kv_budget import KVLayout
from app.core.runner.forward import forward
from app.core.runner.kv_store import KEY_GROUP, VALUE_GROUP, Int8Layer, KVStore, QuantizedKV, quantize_kv
from app.core.sampling import SamplingParams
from app.core.sequence import Sequence
from app.errors import ConfigError

from engine_runs import run_engine


def int8(lm):
    return dataclasses.replace(lm, kv_int8=True)


@pytest.mark.parametrize("dim, group", [(64, VALUE_GROUP), (64, KEY_GROUP), (16, 32), (12, 8)])  # no multiple: 1
def test_each_value_is_within_half_a_step_of_its_group(dim, group):
    x = torch.randn(1, 2, 50, dim) * torch.logspace(-3, 2, 50)[None, None, :, None]  # tokens of very different size
    q = quantize_kv(x, group)
    assert q.codes.dtype == torch.int8 and q.scales.dtype == torch.float16
    assert q.scales.shape == (1, 2, 50, dim // group if dim % group == 0 else 1)
    step = q.scales.float().repeat_interleave(dim // q.scales.shape[-1], dim=-1)
    err = (q.dequantize(torch.float32) - x).abs()
    # round to nearest on the scale as stored; a scale below fp16's normal range (a group under ~0.008) is rounded
    # by up to 2^-25, so its largest value may lie past 127 steps: by at most 127 x 2^-25
    subnormal = (step < torch.finfo(torch.float16).tiny) * 127 * 2.0**-25
    assert (err <= step / 2 * (1 + 1e-3) + subnormal).all()
    assert torch.equal(quantize_kv(torch.zeros(1, 1, 3, dim), group).dequantize(torch.float32),
                       torch.zeros(1, 1, 3, dim))


def test_a_layer_appends_codes_in_place_and_hands_attention_its_rounded_values():
    layer, x = Int8Layer(), torch.randn(1, 2, 300, 64)
    dense, _ = layer.update(x[:, :, :10], -x[:, :, :10])  # a prefill: dense values, the model's dtype
    assert dense.dtype == torch.float32
    assert torch.equal(dense, quantize_kv(x[:, :, :10], KEY_GROUP).dequantize(torch.float32))
    for t in range(10, 300):  # decode rows: views of the codes where they lie
        keys, values = layer.append(x[:, :, t : t + 1], -x[:, :, t : t + 1])
    assert isinstance(keys, QuantizedKV) and keys.shape == (1, 2, 300, 64)
    assert torch.equal(keys.dequantize(torch.float32), quantize_kv(x, KEY_GROUP).dequantize(torch.float32))
    assert torch.equal(values.dequantize(torch.float32), -quantize_kv(x, VALUE_GROUP).dequantize(torch.float32))
    assert keys.scales.shape[-1] == 64 // KEY_GROUP and values.scales.shape[-1] == 64 // VALUE_GROUP
    layer.crop(-5)
    assert layer.get_seq_length() == 295 and layer.keys.shape[-2] == 295 and layer.grows == 2  # 256, then 300+


@pytest.mark.parametrize("dim", [64, 16, 12])  # values in 2 groups of 32; in 1 of the head (keys 2 of 8); no multiple
def test_the_layers_one_chain_for_keys_and_values_rounds_as_quantize_kv_does(dim):
    """Int8Layer quantizes a token's keys and values together, into its own layouts: the codes and scales it keeps are
    exactly quantize_kv's, through zero groups, fp16's overflow and subnormal scales."""
    x = torch.randn(1, 2, 40, dim) * torch.logspace(-9, 7, 40)[None, None, :, None]
    x[:, :, 3] = 0
    x[:, 1, 5, : dim // 2] = 0  # a zero group beside others
    layer = Int8Layer()
    for t in range(0, 40, 7):  # chunks, then single tokens
        keys, values = layer.append(x[:, :, t : t + 7].bfloat16(), -x[:, :, t : t + 7].bfloat16())
    for got, want in ((keys, quantize_kv(x.bfloat16(), KEY_GROUP)), (values, quantize_kv(-x.bfloat16(), VALUE_GROUP))):
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
        assert torch.equal(got.dequantize(torch.float32), want.dequantize(torch.float32))
        assert torch.isfinite(got.dequantize(torch.float32)).all()


def test_dropped_drafts_across_a_grow_are_written_over_and_a_copy_holds_the_same_codes():
    """Speculation's rollback (crop) across the point where the storage doubled, then new tokens over the dropped
    ones; a store built from the layer's views (a prefix cache hit) reads the very values the layer does, and a
    padded call's channel-major scratch gets what the layer's own scratch gets."""
    from app.core.runner.packed import _write

    x, drafts = torch.randn(1, 2, 300, 64), torch.randn(1, 2, 12, 64) * 5
    layer = Int8Layer(limit=512)
    layer.append(x[:, :, :250], x[:, :, :250])
    layer.append(drafts, -drafts)  # 250 -> 262: past the first 256 tokens of storage
    assert layer.grows == 2
    layer.crop(-12)  # all drafts rejected
    for t in range(250, 300):
        keys, values = layer.append(x[:, :, t : t + 1], x[:, :, t : t + 1])
    assert torch.equal(keys.dequantize(torch.float32), quantize_kv(x, KEY_GROUP).dequantize(torch.float32))
    assert torch.equal(values.dequantize(torch.float32), quantize_kv(x, VALUE_GROUP).dequantize(torch.float32))
    copy = Int8Layer()
    copy.append(keys[:, :, :100], values[:, :, :100])  # as KVStore.holding restores a hit's blocks
    copy.append(keys[:, :, 100:], values[:, :, 100:])
    for mine, theirs in ((copy.keys, keys), (copy.values, values)):
        assert torch.equal(mine.dequantize(torch.float32), theirs.dequantize(torch.float32))
        padded = torch.zeros(1, 2, 310, 64)  # `_left_padded`: channels innermost, 10 tokens of padding
        _write(padded[0, :, 10:], theirs[0])
        assert torch.equal(padded[:, :, 10:], theirs.dequantize(torch.float32)) and not padded[:, :, :10].any()


def test_the_kv_budget_counts_about_half_the_bytes_and_the_store_holds_what_it_counts(tiny_lm):
    config = tiny_lm.model.config  # 2 layers, 2 KV heads of 16 channels: keys 4 scales, values 1, per token
    bf16, eight = KVLayout.from_config(config, torch.bfloat16), KVLayout.from_config(config, torch.bfloat16, True)
    assert bf16.bytes_per_token == 2 * 2 * 2 * 16 * 2 and eight.bytes_per_token == 2 * 2 * (16 + 16 + 2 * (4 + 1))
    from transformers import Qwen2Config

    qwen = Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, num_hidden_layers=24)  # 0.5B
    ratio = KVLayout.from_config(qwen, torch.bfloat16, True).bytes_per_token / KVLayout.from_config(
        qwen, torch.bfloat16).bytes_per_token
    assert ratio == pytest.approx((96 + 68) / 256)  # keys 6 bytes per 4, values 34 per 32, against bf16's 2 a value
    seq = Sequence(tiny_lm.model, tiny_lm.tokenizer, list(range(5, 45)), SamplingParams(max_tokens=1),
                   tiny_lm.eos_ids, tiny_lm.max_context, kv_int8=True)
    forward(tiny_lm.model, [(seq, 40)])
    held = sum(t.numel() * t.element_size() for layer in seq.cache.layers for t in layer._storage)
    assert held == eight.bytes_for(seq.cache.layers[0].capacity)


def test_the_budget_admits_the_tokens_the_smaller_cache_saves(tiny_lm):
    """With a budget for one request's worst case in bf16-sized KV, int8 runs about two at once."""
    prompts = [(list(range(5 + i, 45 + i)), SamplingParams(max_tokens=20, do_sample=False, ignore_eos=True))
               for i in range(4)]
    one = KVLayout.from_config(tiny_lm.model.config, tiny_lm.dtype).bytes_for(60)
    _, plain = run_engine(tiny_lm, prompts, together=True, kv_cache_bytes=one + 1, speculative="off")
    _, small = run_engine(int8(tiny_lm), prompts, together=True, kv_cache_bytes=one + 1, speculative="off")
    assert plain.kv_budget.capacity // plain.kv_layout.bytes_for(60) == 1
    assert small.kv_budget.capacity // small.kv_layout.bytes_for(60) >= 3  # fp32's 4 bytes against ~1.1


def logits_over(lm, ids, kv_int8, chunk=8):
    """Logits at every position, the prompt fed `chunk` tokens at a time then one at a time: later positions read
    the cache as each path keeps it."""
    seq = Sequence(lm.model, lm.tokenizer, ids, SamplingParams(max_tokens=1), lm.eos_ids, lm.max_context,
                   kv_int8=kv_int8)
    out, fed = [], 0
    while fed < len(ids):
        n = chunk if fed < chunk * 2 else 1
        n = min(n, len(ids) - fed)
        out.append(forward(lm.model, [(seq, n)], [n]))
        fed += n
    return torch.cat(out)


def test_int8_logits_stay_close_to_the_full_width_cache(tiny_lm):
    ids = list(range(5, 69))
    full, eight = logits_over(tiny_lm, ids, False), logits_over(tiny_lm, ids, True)
    assert not torch.equal(full, eight)  # it does round
    assert (eight - full).abs().max() < 0.05 * full.abs().max()
    assert (eight.argmax(-1) == full.argmax(-1)).float().mean() > 0.95


def test_a_prefix_cache_hit_restores_the_very_values_a_cold_run_attends_to(tiny_lm):
    prompt = tiny_lm.encode_chat([{"role": "user", "content": "a prompt long enough to fill some blocks " * 4}])
    params = SamplingParams(max_tokens=12, do_sample=False, ignore_eos=True, logprobs=0)
    cold, _ = run_engine(int8(tiny_lm), [(prompt, params)], prefix_cache_bytes=0, speculative="off")
    warm, engine = run_engine(int8(tiny_lm), [(prompt, params), (prompt, params)], prefix_cache_bytes=2**20,
                              speculative="off")
    assert warm[1].cached_tokens > 0 and warm[1].tokens == warm[0].tokens == cold[0].tokens
    block = next(iter(engine.prefix_cache._blocks.values()))
    assert isinstance(block.keys, QuantizedKV) and block.keys.codes.dtype == torch.int8


def test_speculation_and_packing_keep_int8s_greedy_tokens(tiny_lm):
    prompts = [tiny_lm.encode_chat([{"role": "user", "content": text}])
               for text in ("one two three one two three one two", "a b c", "repeat repeat repeat repeat")]
    params = SamplingParams(max_tokens=24, do_sample=False, ignore_eos=True)
    alone, _ = run_engine(int8(tiny_lm), [(p, params) for p in prompts], speculative="off")
    together, _ = run_engine(int8(tiny_lm), [(p, params) for p in prompts], together=True, speculative="ngram")
    assert [s.tokens for s in together] == [s.tokens for s in alone]


def test_batch_invariance_holds_with_an_int8_cache(tiny_lm):
    lm = dataclasses.replace(tiny_lm, kv_int8=True, batch_invariant=True)
    prompts = [tiny_lm.encode_chat([{"role": "user", "content": "word " * n}]) for n in (3, 17, 40)]
    params = SamplingParams(max_tokens=16, do_sample=False, ignore_eos=True, logprobs=0)
    alone, _ = run_engine(lm, [(p, params) for p in prompts], speculative="off")
    amid, _ = run_engine(lm, [(p, params) for p in prompts], together=True, speculative="off")
    assert [s.tokens for s in amid] == [s.tokens for s in alone]


def test_settings_it_cannot_serve_are_refused_before_loading(tiny_dir):
    with pytest.raises(ValueError, match="KV_CACHE_DTYPE=int8"):
        Settings(kv_cache_dtype="int8", decode_step="compiled")
    with pytest.raises(ValueError, match="KV_CACHE_DTYPE=int8"):
        Settings(kv_cache_dtype="int8", tensor_parallel=2)
    assert Settings(kv_cache_dtype="int8").kv_cache_dtype == "int8"


def test_a_latent_attention_model_is_refused_naming_the_setting(tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    from app.models.loading import load_model

    config = DeepseekV2Config(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128,
                              moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                              first_k_dense_replace=2, max_position_embeddings=128)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_model(str(tmp_path), device="cpu", dtype="float32", kv_cache_dtype="int8")
    assert err.value.param == "kv_cache_dtype" and "MLA" in str(err.value)
