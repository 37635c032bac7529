"""BATCH_INVARIANT's linears (app/models/invariance.py, row_check.py): loaded with batch_invariant, every linear,
lm_head included, computes a row the same way, bit for bit, in a call of any number of rows as alone, in fp32,
int8 (dynamic and weight-only) and int4; a kernel that fails the load-time check is refused and the next way of
calling it is used; and the flag changes nothing outside the engine's passes in fp32 (the oracle)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from app.core.generate import prefill
from app.core.sampling import SamplingParams
from app.core.sequence import Sequence
from app.models import batch_rows, prepack, row_check
from app.models.batch_rows import BatchRowsLinear, use_batch_rows
from app.models.invariance import LINEAR_KINDS, SPLIT_NAMES, make_linears_invariant
from app.models.loading import load_model
from app.models.quant import DynamicInt8Linear, Int4Linear, WeightOnlyInt8Linear, quantize_linears
from app.models.row_check import RowSplitLinear, first_variant_rows

from conftest import build_tiny_model
from cpu_flags import SAPPHIRE_RAPIDS_FLAGS

ROWS = (1, 2, 3, 8, 17, 64, 129)


def linears(model) -> dict[str, nn.Module]:
    """name -> each linear as the model calls it (a RowSplitLinear counts as its layer)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, RowSplitLinear) or (type(m) in LINEAR_KINDS and not name.endswith(".layer"))}


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
    assert lm.batch_invariant and "each computes a row the same way in a call of 1-129 rows" in lm.invariance
    layers = linears(lm.model)
    assert "lm_head" in layers and len(layers) == 15
    for name, layer in layers.items():
        assert rows_differ_from_alone(layer, layer.in_features) == [], name


def test_weight_only_int8_and_bf16_compute_a_row_the_same_way_at_any_row_count(tiny_tokenizer):
    for dtype, quant in ((torch.float32, "int8"), (torch.bfloat16, None)):
        model = build_tiny_model(len(tiny_tokenizer)).to(dtype)
        if quant:
            quantize_linears(model, quant, kernel="weight_only", batch_invariant=True)
        assert ("weight-only int8" if quant else "F.linear bfloat16") in make_linears_invariant(model, dtype)
        for name, layer in linears(model).items():
            assert rows_differ_from_alone(layer, layer.in_features, dtype) == [], name


def test_without_batch_invariant_rows_differ_and_the_flag_is_what_fixes_them(tiny_dir):
    """The default (off) keeps the speed rules: in fp32 one row on F.linear, several on the packed copy; in int8 a
    call's shared quantization scale. Both give a row that differs from itself alone."""
    for settings in (dict(dtype="float32"), dict(quant="int8")):
        lm = load_model(str(tiny_dir), device="cpu", batch_invariant="off", **settings)
        assert not lm.batch_invariant
        assert rows_differ_from_alone(lm.model.lm_head, lm.model.lm_head.in_features) != []


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


def test_int4_never_takes_its_bf16_copy_under_batch_invariant(tiny_tokenizer, monkeypatch, caplog):
    """INT4_WIDE_COPY on a native-bf16 CPU (an AMX Xeon, by its flags): the copy computes a row of a wide call
    otherwise than alone, so batch invariance leaves it out and the start log says so."""
    from app.models import cpu, quant

    monkeypatch.setattr(quant, "cpu_features", lambda: cpu.features_from_cpuinfo(SAPPHIRE_RAPIDS_FLAGS))
    for invariant in (False, True):
        model = build_tiny_model(len(tiny_tokenizer))
        with caplog.at_level(logging.INFO, logger="app.models.quant"):
            quantize_linears(model, "int4", wide_copy=True, batch_invariant=invariant)
        copies = [m.wide is not None for m in model.modules() if isinstance(m, Int4Linear)]
        assert copies and all(has_copy != invariant for has_copy in copies)
    assert "INT4_WIDE_COPY asked for, but BATCH_INVARIANT is on: every call on the int4 kernel" in caplog.text


def test_a_variant_kernel_is_refused_and_the_next_way_of_calling_it_is_used(monkeypatch, caplog):
    """A kernel whose row depends on the call's row count (an injected fault) is split into fixed tiles; one whose
    row depends on its place in the tile too runs one call per row. The answers are then invariant either way."""
    real = WeightOnlyInt8Linear.forward
    by_count = lambda self, x: real(self, x) * (1 + 1e-3 * (x.numel() // self.in_features))  # noqa: E731
    by_place = lambda self, x: real(self, x) * (1 + 1e-3 * torch.arange(x.shape[-2])[:, None])  # noqa: E731
    for fault, split in ((by_count, "tiles"), (by_place, "rows")):
        monkeypatch.setattr(WeightOnlyInt8Linear, "forward", fault)
        model = nn.Sequential(*(WeightOnlyInt8Linear(nn.Linear(n_in, n_out)) for n_in, n_out in ((64, 96), (96, 64))))
        with caplog.at_level(logging.INFO, logger="app.models.invariance"):
            summary = make_linears_invariant(model, torch.float32)
        assert f"weight-only int8, {SPLIT_NAMES[split]}: 2 layers" in summary
        layers = linears(model)
        assert all(isinstance(m, RowSplitLinear) and m.split == split for m in layers.values())
        assert "computed a row otherwise in a call of" in caplog.text
        for name, layer in layers.items():
            assert rows_differ_from_alone(layer, layer.in_features) == [], name


def test_a_packed_fp32_copy_that_is_not_invariant_is_dropped_for_f_linear(tiny_dir, monkeypatch):
    """oneDNN's packed copy, made variant here (within rounding, so it passes the closeness check): every shape
    falls back to F.linear (whole, in tiles or per row, as this CPU's MKL allows) and keeps no copy."""
    real = batch_rows.packed_linear
    monkeypatch.setattr(batch_rows, "packed_linear",
                        lambda x, w, b: real(x, w, b) * (1 + 1e-7 * (x.numel() // x.shape[-1])))
    lm = load_model(str(tiny_dir), device="cpu", dtype="float32", batch_invariant="on")
    assert lm.prepack == ("off: oneDNN's packed fp32 kernel did not compute a row the same way at every row count "
                          "here (BATCH_INVARIANT)")
    assert "F.linear fp32" in lm.invariance and "oneDNN packed" not in lm.invariance
    for name, layer in linears(lm.model).items():
        assert isinstance(layer, BatchRowsLinear) and layer.packed_weight is None and layer.invariant[0] == "plain"
        assert rows_differ_from_alone(layer, layer.in_features) == [], name


def test_bf16_prepacking_takes_the_first_batch_hint_whose_kernel_is_invariant(monkeypatch):
    """Native-bf16 CPUs cannot be run here: a stand-in packed kernel that is variant with hint 1 and invariant
    with hint 8 (fp32 oneDNN's own behaviour on this CPU) is packed with 8; one variant with both stays plain."""

    class FakePacked(nn.Module):
        def __init__(self, linear, batch_hint=1):
            super().__init__()
            self.in_features, self.out_features, self.hint = linear.in_features, linear.out_features, batch_hint
            self.weight, self.bias = linear.weight, linear.bias

        def forward(self, x):  # [rows, in]: one F.linear per row, invariant; times the row count, not
            out = torch.cat([F.linear(row[None], self.weight, self.bias) for row in x])
            return out * (1 + 1e-2 * x.shape[-2]) if self.hint in variant else out

    monkeypatch.setattr(prepack, "PackedLinear", FakePacked)
    for variant, hint in (({1}, 8), ({1, 8}, None)):
        model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 16))
        assert set(prepack.invariant_hints(model).values()) == {hint}


def test_a_large_lm_head_is_checked_at_fewer_row_counts_to_keep_the_load_short():
    assert row_check.rows_to_check(896, 4864) == ROWS  # every body shape of the default model: all of them
    assert row_check.rows_to_check(896, 151_936) == (1, 2, 3, 8)  # its lm_head: reading it is the cost


def test_use_batch_rows_plans_each_shape_once(monkeypatch):
    plans = []
    real = batch_rows.invariant_plan
    monkeypatch.setattr(batch_rows, "invariant_plan", lambda layer: plans.append(layer) or real(layer))
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(4, 6))
    assert use_batch_rows(model, packed=True, invariant=True) == 3
    assert len(plans) == 2 and all(m.invariant is not None for m in model)
