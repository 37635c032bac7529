"""On a CUDA GPU (`make gpu-check` runs these): the exactness oracle, batching and int8 weights, on the device.

Each has a CPU counterpart that runs everywhere: test_generate.py (greedy equals generate()), test_batching.py
(a batch equals solo runs) and test_quant.py (int8 weight-only stays close).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from app.core.generate import generate
from app.core.sampling import SamplingParams
from app.models.quant import quantize_linears

from conftest import MODEL_CACHE, build_tiny_model
from test_batching import check_batch_invariance

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU (CPU counterparts run instead)")]


def greedy(model, tokenizer, ids, n=24):
    params = SamplingParams(max_tokens=n, do_sample=False, ignore_eos=True)
    return [e.token_id for e in generate(model, tokenizer, ids, params, (), 256)]


@pytest.fixture
def cuda_lm(tiny_lm):
    return dataclasses.replace(tiny_lm, model=copy.deepcopy(tiny_lm.model).to("cuda"))


def test_fp32_greedy_equals_hf_generate_on_cuda(cuda_lm):
    ids = cuda_lm.tokenizer.encode("Which city is the capital of France?")
    ours = greedy(cuda_lm.model, cuda_lm.tokenizer, ids)
    with torch.inference_mode():
        hf = cuda_lm.model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=24, min_new_tokens=24,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert ours == hf


def test_batch_equals_solo_on_cuda(cuda_lm):
    check_batch_invariance(cuda_lm, 24)


def test_int8_weight_only_on_cuda_stays_close(tiny_tokenizer):
    model = build_tiny_model(len(tiny_tokenizer)).to("cuda", torch.bfloat16)
    quantized = copy.deepcopy(model)
    assert quantize_linears(quantized, "int8") == "weight_only"
    ids = torch.tensor([tiny_tokenizer.encode("def reverse(s):")], device="cuda")
    with torch.inference_mode():
        a, b = quantized(ids).logits.float(), model(ids).logits.float()
    assert ((a - b).norm() / b.norm()).item() < 0.05


@pytest.mark.real_model
def test_default_model_loads_in_bf16_and_answers_on_cuda():
    from app.models.loading import load_model

    lm = load_model(str(MODEL_CACHE / "qwen2.5-coder-0.5b-instruct"), "cuda", "auto")
    assert lm.device.type == "cuda" and lm.dtype in (torch.bfloat16, torch.float16)
    ids = lm.encode_chat([{"role": "user", "content": "Which city is the capital of France?"}])
    text = lm.tokenizer.decode(greedy(lm.model, lm.tokenizer, ids, n=16))
    assert "Paris" in text


def test_captured_decode_step_gives_eager_greedy_tokens_on_cuda(tiny_tokenizer):
    """DECODE_STEP=compiled on CUDA: the bucketed step captured as CUDA graphs (torch.cuda.graph) decodes
    what the eager step decodes in fp32, and replays without recompiling (tests/compile/test_static_step.py on a CPU)."""
    from test_static_step import PROMPTS, decode_side_by_side

    from app.core.runner.packed import enable_packed_batching
    from app.core.runner.kv_pool import KVPool
    from app.core.runner.static_step import StaticDecodeStep

    torch._dynamo.reset()
    model = build_tiny_model(len(tiny_tokenizer)).to("cuda")
    assert enable_packed_batching(model)
    step = StaticDecodeStep(model, KVPool(model.config, 64, 16, torch.float32, "cuda"), 4, 256, compile=True)
    step.warm_up()
    warm_replays = step.graphs.replays  # the warm-up captures every (bucket, width) graph, replaying each once
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    worst, agree, pooled, eager = decode_side_by_side(step, model, tiny_tokenizer, 40, PROMPTS[:3])
    assert pooled == eager and worst < 1e-3
    assert step.graphs.replays - warm_replays == step.steps == 40  # every step replayed from a captured graph
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
