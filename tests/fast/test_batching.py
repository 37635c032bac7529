"""Batched steps: one packed forward pass for several requests (prefill chunks and decode tokens together) must
give each request exactly the tokens it gets alone."""

from __future__ import annotations

import pytest

from app.core.runner.packed import enable_packed_batching
from app.core.generate import generate
from app.core.runner.forward import forward
from app.core.sequence import Sequence
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
        logits = forward(lm.model, work)
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


@pytest.mark.full
def test_tiny_batch_equals_solo(tiny_lm):
    check_batch_invariance(tiny_lm, 40)


@pytest.mark.real_model
def test_smollm_batch_equals_solo(smollm_fp32):
    check_batch_invariance(smollm_fp32, 32)


def test_packed_pass_writes_into_each_request_cache(tiny_lm):
    prompts = [tiny_lm.encode_text(t) for t in ("short", "a somewhat longer prompt here")]
    params = SamplingParams(max_tokens=4, do_sample=False)
    seqs = [Sequence(tiny_lm.model, tiny_lm.tokenizer, ids, params, tiny_lm.eos_ids, tiny_lm.max_context)
            for ids in prompts]
    assert enable_packed_batching(tiny_lm.model)
    logits = forward(tiny_lm.model, [(seqs[0], len(prompts[0])), (seqs[1], 3)])  # whole prompt + a chunk
    assert logits.shape == (2, tiny_lm.vocab_size)
    assert [s.cache.get_seq_length() for s in seqs] == [len(prompts[0]), 3]
    assert not seqs[0].prefilling and seqs[1].prefilling


def tiny_variant(tiny_lm, config_class, seed=0, **config):
    """The tiny test model's shape under another architecture's config."""
    import torch
    from transformers import AutoModelForCausalLM

    from app.models.loading import LoadedModel

    base = dict(vocab_size=tiny_lm.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_class(**{**base, **config}), dtype=torch.float32,
                                             attn_implementation="sdpa")
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # sharp logits: greedy ties cannot make the comparison flaky
    return LoadedModel(model=model.eval(), tokenizer=tiny_lm.tokenizer, name="tiny-variant", max_context=256,
                       eos_ids=tiny_lm.eos_ids)


def hf_greedy(lm, ids, max_new_tokens):
    import torch

    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.full
@pytest.mark.parametrize("chunk", [5, 16, 64])
def test_sliding_window_without_layer_types_is_honoured_when_packed(tiny_lm, chunk):
    """A Mistral-style config (a sliding_window and no layer_types) slides in every layer; packed prefill chunks
    (shorter and longer than the window) and decode rows must see only the window, as model.generate() does."""
    from transformers import MistralConfig

    lm = tiny_variant(tiny_lm, MistralConfig, sliding_window=8)
    prompts = [lm.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    assert max(len(p) for p in prompts) > 40, "prompts well past the window"
    params = [SamplingParams(max_tokens=20, do_sample=False, ignore_eos=True) for _ in prompts]
    assert batched(lm, prompts, params, chunk=chunk) == [hf_greedy(lm, ids, 20) for ids in prompts]


@pytest.mark.full
def test_mixed_full_and_sliding_layers_are_honoured_when_packed(tiny_lm):
    from transformers import Qwen2Config

    lm = tiny_variant(tiny_lm, Qwen2Config, num_hidden_layers=3, use_sliding_window=True, sliding_window=8,
                      max_window_layers=1)
    assert lm.model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    prompts = [lm.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    params = [SamplingParams(max_tokens=16, do_sample=False, ignore_eos=True) for _ in prompts]
    assert batched(lm, prompts, params) == [hf_greedy(lm, ids, 16) for ids in prompts]


def test_chunked_attention_is_not_packed(tiny_lm):
    from transformers import LlamaConfig

    lm = tiny_variant(tiny_lm, LlamaConfig, attention_chunk_size=16)
    assert not enable_packed_batching(lm.model)
    assert enable_packed_batching(tiny_variant(tiny_lm, LlamaConfig).model)


def test_index_tensors_are_built_once_per_step_not_per_layer(tiny_lm, monkeypatch):
    """On a GPU, torch.tensor(list, device=...) is a host-to-device copy: building one inside every layer of a
    packed pass costs a sync per layer per step. The count of such calls must not grow with the depth."""
    import torch
    from transformers import Qwen2Config

    def tensors_built(num_layers: int) -> int:
        lm = tiny_variant(tiny_lm, Qwen2Config, num_hidden_layers=num_layers)
        assert enable_packed_batching(lm.model)
        params = SamplingParams(max_tokens=4, do_sample=False)
        seqs = [Sequence(lm.model, lm.tokenizer, lm.encode_text(t), params, lm.eos_ids, lm.max_context)
                for t in ("short", "a somewhat longer prompt here", "and a third one")]
        # Two prompts in whole (they decode next), the third one's first chunk: every cache exists already
        # (a new cache's first update builds its own empty tensors, once per request, not per step).
        forward(lm.model, [(seqs[0], seqs[0].prompt_len), (seqs[1], seqs[1].prompt_len), (seqs[2], 2)])
        real, calls = torch.tensor, []

        def counting(*args, **kwargs):
            if kwargs.get("device") is not None:
                calls.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(torch, "tensor", counting)
        try:  # a step with two decode rows and one prefill chunk
            forward(lm.model, [(seqs[0], 1), (seqs[1], 1), (seqs[2], 3)])
        finally:
            monkeypatch.setattr(torch, "tensor", real)
        return len(calls)

    assert tensors_built(2) == tensors_built(6)


def test_waiting_requests_run_in_priority_order_lower_first(tiny_lm):
    """vLLM's `priority`: with one slot busy, the waiting requests start lowest priority first, arrival order among
    equals; batch lines (the background class) wait behind every interactive request, whatever their priority."""
    import asyncio

    from app.core.engine.engine import Engine
    from app.core.sampling import SamplingParams

    async def run() -> list[str]:
        engine = Engine(tiny_lm, max_active=1)
        engine.start()
        await asyncio.to_thread(engine.loaded.wait)
        try:
            busy = engine.submit([1, 2, 3], SamplingParams(max_tokens=64, do_sample=False, ignore_eos=True), "busy")
            order: list[str] = []

            async def run_one(name: str, priority: int) -> None:
                handle = engine.submit([4, 5], SamplingParams(max_tokens=1, do_sample=False, priority=priority), name,
                                       background=name.startswith("batch"))
                async for _ in handle:
                    pass
                order.append(name)

            tasks = [asyncio.ensure_future(run_one(n, p)) for n, p in
                     (("batch-1", 0), ("chat-1", 0), ("batch-2", -10), ("chat-2", 0), ("urgent", -5))]
            async for _ in busy:
                pass
            await asyncio.gather(*tasks)
            return order
        finally:
            engine.stop()

    assert asyncio.run(run()) == ["urgent", "chat-1", "chat-2", "batch-2", "batch-1"]
