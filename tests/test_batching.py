"""Batched steps: one packed forward pass for several requests (prefill chunks and decode tokens together) must
give each request exactly the tokens it gets alone."""

from __future__ import annotations

import pytest

from app.core.batching import enable_packed_batching
from app.core.generate import Sequence, forward_many, generate
from app.core.sampling import SamplingParams

PROMPTS = ["Hi!", "Which city is the capital of France?", "北京是中国的首都。请介绍一下北京的历史和文化。",
           "Emoji are fun: 😀 🎉 and so is café. Tell me a long story about a café in Paris, with many details."]


def solo(lm, ids, params):
    return [e.token_id for e in generate(lm.model, lm.tokenizer, ids, params, lm.eos_ids, lm.max_context)]


def batched(lm, prompts, params_list, chunk=16):
    """As the engine does: every step, each unfinished sequence feeds its next prefill chunk or its newest token,
    all in one packed pass. Prompts of different lengths finish prefill at different steps, so steps mix
    prefill chunks with decode tokens."""
    assert enable_packed_batching(lm.model)
    seqs = [Sequence(lm.model, lm.tokenizer, ids, p, lm.eos_ids, lm.max_context)
            for ids, p in zip(prompts, params_list)]
    outputs = [[] for _ in seqs]
    while True:
        live = [i for i, s in enumerate(seqs) if s.finish_reason is None]
        if not live:
            return outputs
        work = [(seqs[i], min(chunk, seqs[i].prompt_len - seqs[i].cache.get_seq_length()) if seqs[i].prefilling
                 else 1) for i in live]
        logits = forward_many(lm.model, work)
        for row, i in enumerate(live):
            if not seqs[i].prefilling:
                outputs[i].append(seqs[i].choose(logits[row : row + 1]).token_id)


def check_batch_invariance(lm, max_tokens):
    prompts = [lm.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts), "mixed lengths exercise the padding"
    greedy = [SamplingParams(max_tokens=max_tokens - 7 * i, do_sample=False, ignore_eos=True)
              for i in range(len(prompts))]
    assert batched(lm, prompts, greedy) == [solo(lm, ids, p) for ids, p in zip(prompts, greedy)]
    # sampling stays per request: each row keeps its own parameters and generator inside one batch
    mixed = [SamplingParams(max_tokens=12, seed=1, temperature=0.8, top_k=20, ignore_eos=True),
             SamplingParams(max_tokens=12, do_sample=False, ignore_eos=True),
             SamplingParams(max_tokens=12, seed=2, top_p=0.5, repetition_penalty=1.3, ignore_eos=True),
             SamplingParams(max_tokens=12, seed=3, min_p=0.1, stop=("the",))]
    assert batched(lm, prompts, mixed) == [solo(lm, ids, p) for ids, p in zip(prompts, mixed)]


def test_tiny_batch_equals_solo(tiny_lm):
    check_batch_invariance(tiny_lm, 40)


@pytest.mark.real_model
def test_qwen_batch_equals_solo(qwen_fp32):
    check_batch_invariance(qwen_fp32, 32)


@pytest.mark.real_model
def test_smollm_batch_equals_solo(smollm_fp32):
    check_batch_invariance(smollm_fp32, 32)


def test_packed_pass_writes_into_each_request_cache(tiny_lm):
    prompts = [tiny_lm.encode_text(t) for t in ("short", "a somewhat longer prompt here")]
    params = SamplingParams(max_tokens=4, do_sample=False)
    seqs = [Sequence(tiny_lm.model, tiny_lm.tokenizer, ids, params, tiny_lm.eos_ids, tiny_lm.max_context)
            for ids in prompts]
    assert enable_packed_batching(tiny_lm.model)
    logits = forward_many(tiny_lm.model, [(seqs[0], len(prompts[0])), (seqs[1], 3)])  # whole prompt + a chunk
    assert logits.shape == (2, tiny_lm.vocab_size)
    assert [s.cache.get_seq_length() for s in seqs] == [len(prompts[0]), 3]
    assert not seqs[0].prefilling and seqs[1].prefilling
