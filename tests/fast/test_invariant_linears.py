"""BATCH_INVARIANT's linears on this CPU's own kernels (app/models/invariance.py, row_check.py): loaded with
batch_invariant, every linear, lm_head included, computes a row the same way, bit for bit, in a call of any number
of rows as alone, in fp32 (with and without the packed copies), dynamic int8 and int4; and the flag changes
nothing outside the engine's passes in fp32 (the oracle). These kernels choose by CPUID, so `make test-avx2` runs
this file again on an emulated AVX2 CPU. The check's fallbacks, with injected faults, weight-only int8 and bf16:
test_invariant_fallbacks.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from app.core.generate import prefill
from app.core.sampling import SamplingParams
from app.core.sequence import Sequence
from app.models import batch_rows
from app.models.batch_rows import BatchRowsLinear
from app.models.fuse import JoinedProjections
from app.models.invariance import LINEAR_KINDS
from app.models.loading import load_model
from app.models.quant import DynamicInt8Linear
from app.models.row_check import RowSplitLinear, first_variant_rows

ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 17, 64, 129)


def linears(model) -> dict[str, nn.Module]:
    """name -> each linear as the model calls it (a RowSplitLinear counts as its layer)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, RowSplitLinear) or (type(m) in LINEAR_KINDS and not name.endswith(".layer"))}


def first_layer_and_head(model) -> dict[str, nn.Module]:
    """`linears`, of the first decoder layer and lm_head: the second layer's hold the same kinds and shapes, and
    are held here to the same plan (checking each row alone is what makes these tests take seconds emulated)."""
    layers = linears(model)
    plan = lambda m: (type(m), getattr(m, "split", None), getattr(m, "invariant", None),  # noqa: E731
                      getattr(m, "invariant_split", None))
    for name, layer in layers.items():
        if ".layers.1." in name:
            assert plan(layer) == plan(layers[name.replace(".layers.1.", ".layers.0.")]), name
    return {name: layer for name, layer in layers.items() if ".layers.1." not in name}


def rows_differ_from_alone(layer: nn.Module, in_features: int, dtype=torch.float32) -> list[int]:
    """The row counts M at which some row of an M-row call (an engine pass) is not that row alone, bit for bit."""
    x = torch.randn(max(ROWS), in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode(), batch_rows.batch_rows():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
        return [m for m in ROWS if not torch.equal(layer(x[:m]), alone[:m])]


@pytest.mark.parametrize("settings", [dict(dtype="float32"), dict(dtype="float32", prepack="false"),
                                      dict(quant="int8"), dict(quant="int4", int4_wide_copy=True)],
                         ids=["fp32", "fp32-no-copies", "int8-dynamic", "int4"])
def test_every_linear_computes_a_row_the_same_way_at_any_row_count(tiny_dir, settings):
    lm = load_model(str(tiny_dir), device="cpu", batch_invariant="on", **settings)
    assert lm.batch_invariant and "each computes a row the same way in a call of 1-8, 17, 64 and 129 rows" in lm.invariance
    joined = sum(len(group.sizes) - 1 for group in lm.model.modules() if isinstance(group, JoinedProjections))
    assert "lm_head" in linears(lm.model) and len(linears(lm.model)) == 15 - joined  # int4's q/k/v, gate/up: one
    for name, layer in first_layer_and_head(lm.model).items():
        assert rows_differ_from_alone(layer, layer.in_features, lm.dtype) == [], name  # int4: bf16 where native


def test_without_batch_invariant_the_speed_rules_stay(tiny_dir):
    """The default (off): int8's call shares one quantization scale, so a row differs with its neighbours; fp32's
    one row in an engine pass is still F.linear itself (the packed copy only for several rows)."""
    int8 = load_model(str(tiny_dir), device="cpu", quant="int8", batch_invariant="off")
    gate = int8.model.model.layers[0].mlp.gate_proj
    assert not int8.batch_invariant and rows_differ_from_alone(gate, 64) != []
    fp32 = load_model(str(tiny_dir), device="cpu", dtype="float32", batch_invariant="off")
    head, row = fp32.model.lm_head, torch.randn(1, 64)
    assert isinstance(head, BatchRowsLinear) and head.invariant is None and head.packed_weight is not None
    with torch.inference_mode(), batch_rows.batch_rows():
        assert torch.equal(head(row), F.linear(row, head.weight))


def test_fp32_generate_is_unchanged_by_the_flag_and_still_model_generate(tiny_dir):
    """Outside the engine's passes (`generate()`, the oracle) every fp32 linear stays F.linear: the prompt's
    logits bit for bit the same with the flag on and off, and greedy tokens model.generate()'s."""
    on, off = (load_model(str(tiny_dir), device="cpu", dtype="float32", batch_invariant=mode) for mode in ("on", "off"))
    ids = list(range(5, 40))

    def first_logits(lm):
        seq = Sequence(lm.model, lm.tokenizer, ids, SamplingParams(max_tokens=4, do_sample=False), (), lm.max_context)
        return prefill(lm.model, seq)

    assert torch.equal(first_logits(on), first_logits(off))
    from app.core.generate import generate

    ours = [e.token_id for e in generate(on.model, on.tokenizer, ids, SamplingParams(max_tokens=12, do_sample=False,
                                                                                    ignore_eos=True), (), 256)]
    with torch.inference_mode():
        hf = on.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
    assert ours == hf[0, len(ids):].tolist()


def test_dynamic_int8_differs_by_its_neighbours_and_the_anchor_row_fixes_it():
    torch.manual_seed(0)
    linear = nn.Linear(896, 896)  # a real shape: the default model's q_proj
    assert first_variant_rows(DynamicInt8Linear(linear), 896, torch.float32) is not None
    anchored = DynamicInt8Linear(linear, anchored=True)
    assert first_variant_rows(anchored, 896, torch.float32) is None
    x = torch.randn(5, 896)  # and still the layer: within int8 rounding of fp32
    torch.testing.assert_close(anchored(x), linear(x).detach(), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("settings", [dict(dtype="float32"), dict(quant="int8"), dict(quant="int4")],
                         ids=["fp32", "int8", "int4"])
def test_a_batched_prefill_gives_each_prompt_its_logits_alone_bit_for_bit(tiny_dir, settings):
    """What a user sees: three prompts prefilled in one engine pass get the logits (so the logprobs and the first
    token) each gets alone, bit for bit, with the flag. Without it, int8's dynamic lm_head (int4's too, in fp32)
    quantizes the pass's rows with one shared scale, so they differ; fp32's (F.linear alone, the packed copy
    together) may, and a weight-only int8 head (int4's in bf16, int8's tied one where the CPU has native bf16: row
    by row) need not."""
    from app.core.runner.forward import forward
    from app.core.runner.packed import enable_packed_batching

    prompts = [list(range(5, 5 + n)) for n in (7, 12, 19)]
    for mode in ("off", "on"):
        lm = load_model(str(tiny_dir), device="cpu", batch_invariant=mode, **settings)
        assert enable_packed_batching(lm.model)

        def seqs():
            return [Sequence(lm.model, lm.tokenizer, ids, SamplingParams(max_tokens=2, do_sample=False), (),
                             lm.max_context) for ids in prompts]

        together = forward(lm.model, [(s, s.prompt_len) for s in seqs()])  # [3, vocab]
        alone = torch.cat([forward(lm.model, [(s, s.prompt_len)]) for s in seqs()])
        if mode == "on":
            assert torch.equal(together, alone), mode
        elif isinstance(lm.model.lm_head, DynamicInt8Linear):  # int4 in bf16 has a weight-only head: rows alone
            assert not torch.equal(together, alone), mode
