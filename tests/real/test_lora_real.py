"""LoRA adapters on the real embedded models, in fp32: adapters made with peft (random non-zero weights, on every
linear of the body or on attention only), served in one batch with the base, each row's greedy tokens equal to
peft's merged model's `generate()` (the base row's to the base's). A few tokens: the claim is exactness, not
length."""

from __future__ import annotations

import gc

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from app.models.fetch import fetch_model
from app.models.loading import load_model
from app.models.lora import LoraAdapters
from conftest import MODEL_CACHE
from test_lora import ALL_LINEARS, reference, serve

pytestmark = pytest.mark.real_model
PROMPTS = ["Write a Python function that checks whether a number is prime.", "What is the capital of France?"]
NEW_TOKENS = 8
ADAPTERS = {"alpha": (1, ALL_LINEARS, 8), "beta": (2, ["q_proj", "v_proj"], 16)}  # seed, targets, rank


def hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def save_adapter(path: str, where, seed: int, targets: list[str], rank: int):
    """A peft adapter with random weights big enough to change the answer; returns peft's merged model."""
    peft_model = get_peft_model(hf_model(path), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                           init_lora_weights=False))
    # 0.07: enough to change the answers (0.05 changed none of SmolLM's 8 tokens), and not so much that the
    # activations blow up: at 0.1, Qwen's logits through peft's own unmerged and merged models differed by 0.16
    # (rounding amplified), enough to swap a top-2 pair, so no oracle could settle the token.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.07)
    peft_model.save_pretrained(where)
    return peft_model.merge_and_unload().eval()


@pytest.mark.parametrize("model_name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_base_and_two_adapters_in_one_batch_equal_their_own_references_in_fp32(model_name, tmp_path):
    path = str(fetch_model(model_name, MODEL_CACHE))
    # One fp32 copy of the model at a time: the references first, each freed before the next, then ours. Held
    # together (ours, the base's reference and peft's merged model: 6 GB for Qwen), they were the largest part of
    # a worker that the kernel's OOM killer stopped on a 24 GB AVX2-only Zen 3, where the suite's servers run fp32.
    lm = load_model(path, device="cpu", dtype="float32", prepack="false")
    prompts = [lm.encode_chat([{"role": "user", "content": text}]) for text in PROMPTS]
    eos_ids = lm.eos_ids
    del lm  # loaded again below, once the references are done
    gc.collect()
    with torch.inference_mode():
        base = hf_model(path)
        expected = {None: [reference(base, ids, NEW_TOKENS, eos_ids) for ids in prompts]}
        del base
        gc.collect()
    paths = {}
    for name, (seed, targets, rank) in ADAPTERS.items():
        paths[name] = str(tmp_path / name)
        merged = save_adapter(path, paths[name], seed, targets, rank)
        with torch.inference_mode():
            expected[name] = [reference(merged, ids, NEW_TOKENS, eos_ids) for ids in prompts]
        del merged
        gc.collect()
    lm = load_model(path, device="cpu", dtype="float32", prepack="false")
    requests = [(ids, name) for ids in prompts for name in (None, "alpha", "beta")]
    tokens, _, engine = serve(lm, LoraAdapters(lm.name, paths), requests, n=NEW_TOKENS)
    assert engine.batch_decode
    assert tokens == [expected[name][prompts.index(ids)] for ids, name in requests]
    assert expected["alpha"] != expected[None]  # the adapter did change the answer
