"""On a CUDA GPU (`make gpu-check` runs these): the architecture matrix's families in fp32 on the device, each
one's greedy tokens alone and four at once (the packed pass) against `model.generate()`'s on the same device.

The CPU counterpart is tests/fast/test_model_matrix.py, which runs every path for every family (tests/arch_models.py);
here only `solo` and `batched`, whose cells must equal the ones it records in docs/results/model-matrix.json: a
family that is packed on a CPU is packed on a GPU too, and gives generate()'s tokens there as well.
"""

from __future__ import annotations

import json

import pytest
import torch

from app.models.loading import LoadedModel
from arch_models import FAMILIES, build
from engine_runs import run_engine
from test_model_matrix import GREEDY, N, RECORDED, TEXTS, verdict

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU (CPU counterparts run instead)")]

DEVICE = "cuda"


@pytest.mark.parametrize("family", FAMILIES)
def test_family_solo_and_batched_give_generates_tokens_on_cuda(family, tiny_tokenizer):
    model = build(family, len(tiny_tokenizer)).to(DEVICE)
    prompts = [tiny_tokenizer.encode(text) for text in TEXTS]
    expected = [model.generate(torch.tensor([p], device=DEVICE), max_new_tokens=N, min_new_tokens=N,
                               do_sample=False)[0, len(p):].tolist() for p in prompts]
    lm = LoadedModel(model=model, tokenizer=tiny_tokenizer, name=family, max_context=256, eos_ids=())
    requests = [(p, GREEDY) for p in prompts]

    solo, _ = run_engine(lm, requests)
    batched, engine = run_engine(lm, requests, together=True)
    row = {"solo": verdict(solo, expected),
           "batched": verdict(batched, expected) + ("" if engine.batch_decode else ", one per pass")}
    recorded = json.loads(RECORDED.read_text())["families"][family]
    assert row == {path: recorded[path] for path in row}, f"{family} on {DEVICE}: {row}, on a CPU: {recorded}"
