"""The architecture matrix's `compiled` column with inductor itself (tests/fast/test_model_matrix.py runs the pooled
step uncompiled for every family): two families whose layers differ most from the tiny Qwen2 that
test_static_step.py compiles, Qwen3 (QK norms per head) and DeepSeek-V3 (MLA: the pool holds latents the
model expands; MoE routing), in fp32, greedy tokens equal to
`model.generate()`'s with most decode steps taken by the compiled step."""

from __future__ import annotations

import pytest
import torch

from app.core.sampling import SamplingParams
from app.models.loading import LoadedModel
from arch_models import build
from engine_runs import run_engine

pytestmark = pytest.mark.compile  # the whole module: see the Makefile's `test` target

TEXTS = ("The capital of France is Paris. Paris is a city on the Seine.", "def reverse(s):\n    return s[::-1]")
N = 16


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_compiled_decode_step_gives_generates_tokens(family, tiny_tokenizer):
    torch._dynamo.reset()
    model = build(family, len(tiny_tokenizer))
    prompts = [tiny_tokenizer.encode(text) for text in TEXTS]
    expected = [model.generate(torch.tensor([p]), max_new_tokens=N, min_new_tokens=N, do_sample=False)[0, len(p):]
                .tolist() for p in prompts]
    lm = LoadedModel(model=model, tokenizer=tiny_tokenizer, name=family, max_context=256, eos_ids=())
    greedy = SamplingParams(max_tokens=N, do_sample=False, ignore_eos=True)
    seen, engine = run_engine(lm, [(p, greedy) for p in prompts], together=True, max_active=2,
                              decode_step="compiled")
    assert [s.tokens for s in seen] == expected
    assert engine._runner.static_decode.steps > N // 2
