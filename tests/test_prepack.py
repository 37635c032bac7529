"""Prepacked bf16 linears on CPU (app/prepack.py): faster, and the same tokens, bit for bit, as transformers'
own model. Also the bench that reports it, run end to end on a tiny model saved to disk."""

from __future__ import annotations

import argparse
import copy
import logging

import pytest
import torch
from torch import nn

from app.bench import generate as bench_generate
from app.config import Settings
from app.core.generate import generate
from app.models.loading import load_model
from app.models.prepack import PackedLinear, decode_bytes_per_step, prepack_linears, prepack_supported
from app.core.sampling import SamplingParams

from conftest import MODEL_CACHE, build_tiny_model

pytestmark = pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.bfloat16),
                                reason="this CPU/torch build has no oneDNN bf16 prepacking")
PROMPTS = ["Which city is the capital of France?", "北京是中国的首都。请介绍一下北京。", "def reverse(s):"]


def linears(model) -> tuple[int, int]:
    kinds = [type(m) for m in model.modules()]
    return kinds.count(nn.Linear), kinds.count(PackedLinear)


def greedy(lm_model, tokenizer, ids, eos_ids, n=24, ignore_eos=True):
    params = SamplingParams(max_tokens=n, do_sample=False, ignore_eos=ignore_eos)
    return [e.token_id for e in generate(lm_model, tokenizer, ids, params, eos_ids, 256)]


@pytest.fixture(scope="module")
def tiny_pair(tiny_tokenizer):
    plain = build_tiny_model(len(tiny_tokenizer)).to(torch.bfloat16)
    packed = copy.deepcopy(plain)
    assert prepack_linears(packed) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and lm_head
    return plain, packed


def test_every_linear_is_packed_and_logits_are_bit_identical(tiny_pair, tiny_tokenizer):
    plain, packed = tiny_pair
    assert linears(plain) == (15, 0) and linears(packed) == (0, 15)
    for text in PROMPTS:
        ids = torch.tensor([tiny_tokenizer.encode(text)])
        with torch.inference_mode():
            assert torch.equal(plain(ids).logits, packed(ids).logits)


def test_greedy_tokens_identical_to_the_plain_model(tiny_pair, tiny_tokenizer):
    plain, packed = tiny_pair
    eos = (tiny_tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    for text in PROMPTS:
        ids = tiny_tokenizer.encode(text)
        assert greedy(packed, tiny_tokenizer, ids, eos) == greedy(plain, tiny_tokenizer, ids, eos)


def test_a_layer_that_would_change_results_stays_plain(tiny_tokenizer, monkeypatch, caplog):
    model = build_tiny_model(len(tiny_tokenizer)).to(torch.bfloat16)
    forward = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: forward(self, x) + 1)  # a wrong kernel
    with caplog.at_level(logging.WARNING, logger="app.models.prepack"):
        assert prepack_linears(model) == 0
    assert linears(model) == (15, 0)
    assert "15 linear layers gave different results" in caplog.text


def test_bytes_per_decode_step_skip_the_embedding_table_and_count_a_tied_head_once(tiny_tokenizer):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    head = config.vocab_size * 64 * 2
    per_layer = (64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3 + 2 * 64) * 2  # q, o; k, v; gate, up, down; two norms
    expected = 2 * per_layer + 64 * 2 + head  # + final norm + lm_head (the embedding table itself is skipped)
    assert decode_bytes_per_step(model) == expected
    prepack_linears(model)
    assert decode_bytes_per_step(model) == expected  # the same bytes, now in oneDNN's layout


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model(len(tiny_tokenizer)).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def test_load_model_prepacks_bf16_on_cpu_unless_turned_off(tiny_dir, monkeypatch):
    assert linears(load_model(str(tiny_dir), "cpu", "bfloat16").model) == (0, 15)
    assert linears(load_model(str(tiny_dir), "cpu", "bfloat16", prepack=False).model) == (15, 0)
    assert linears(load_model(str(tiny_dir), "cpu", "float32").model) == (15, 0)  # fp32 would not be bit-identical
    monkeypatch.setenv("PREPACK", "false")
    assert Settings().prepack is False


def test_bench_generate_reports_every_contender_and_exact_kv_memory(tiny_dir, tmp_path, capsys):
    args = argparse.Namespace(model=str(tiny_dir), device="cpu", dtype="bfloat16", prepack=None, max_tokens=8,
                              repeats=1, kv_streams=2, kv_tokens=32, out=str(tmp_path / "bench.json"))
    result = bench_generate.run(args)
    printed = capsys.readouterr().out
    for label in ("our loop, prepacked", "our loop, plain weights", "model.generate(), plain", "floor",
                  "our loop, QUANT=int8"):
        assert label in printed
    assert result["prepacked"] is True
    for key in ("ours", "ours_plain", "hf_generate", "hf_generate_prepacked", "ours_int8"):
        assert result[f"{key}_tokens_per_s"] > 0
    assert result["kv_bytes_held"] == result["kv_bytes_theory"] == 2 * 32 * 2 * 2 * 2 * 16 * 2
    assert (tmp_path / "bench.json").is_file()


@pytest.mark.real_model
def test_prepacked_qwen_bf16_gives_transformers_own_greedy_tokens():
    """The server's default on CPU (bf16, prepacked) against transformers' generate() on the model as
    transformers loads it: the same 48 tokens, in English, Chinese and code."""
    path = str(MODEL_CACHE / "qwen2.5-coder-0.5b-instruct")
    packed = load_model(path, "cpu", "bfloat16")
    plain = load_model(path, "cpu", "bfloat16", prepack=False)
    assert linears(packed.model)[0] == 0 and linears(plain.model)[1] == 0
    for text in ("Describe Paris in detail.", "请用中文介绍一下北京的历史。", "Write a Python prime test."):
        ids = packed.encode_chat([{"role": "user", "content": text}])
        ours = greedy(packed.model, packed.tokenizer, ids, packed.eos_ids, n=48, ignore_eos=False)
        with torch.inference_mode():
            hf = plain.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      do_sample=False, repetition_penalty=1.0, max_new_tokens=48,
                                      eos_token_id=list(packed.eos_ids), pad_token_id=0)[0, len(ids):].tolist()
        assert len(ours) >= 24 and ours == hf
