"""BATCH_INVARIANT's load-time check and its fallbacks (app/models/row_check.py, invariance.py), on any CPU: a
kernel made variant on purpose is refused and the next way of calling it is used (fixed tiles, one call per row,
F.linear instead of the packed fp32 copy, another bf16 batch hint), int4's bf16 copy is never made, and the check
stays cheap on a large lm_head. The real kernels' own invariance: test_invariant_linears.py."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from app.models import batch_rows, prepack, row_check
from app.models.batch_rows import BatchRowsLinear, use_batch_rows
from app.models.invariance import SPLIT_NAMES, make_linears_invariant
from app.models.loading import load_model
from app.models.quant import WeightOnlyInt8Linear, quantize_linears
from app.models.quant_int4 import Int4Linear
from app.models.row_check import RowSplitLinear

from conftest import build_tiny_model
from cpu_flags import SAPPHIRE_RAPIDS_FLAGS
from test_invariant_linears import ROWS, first_layer_and_head, linears, rows_differ_from_alone


def test_bf16_computes_a_row_the_same_way_at_any_row_count(tiny_dir):
    """bf16 as loaded: on a CPU with oneDNN's bf16 reorder, prepacked with a batch hint that passed the check (or
    plain where none did); elsewhere (as here) plain F.linear as checked, or its fallback. lm_head included."""
    lm = load_model(str(tiny_dir), device="cpu", dtype="bfloat16", prepack="true" if prepack.prepack_supported(
        torch.device("cpu"), torch.bfloat16) else "auto", batch_invariant="on")
    assert "bfloat16, " in lm.invariance
    assert "lm_head" in linears(lm.model) and len(linears(lm.model)) == 15
    for name, layer in first_layer_and_head(lm.model).items():
        assert rows_differ_from_alone(layer, layer.in_features, torch.bfloat16) == [], name


def test_weight_only_int8_computes_a_row_the_same_way_at_any_row_count(tiny_tokenizer):
    """The kernel QUANT=int8 takes with bf16 activations, on a GPU or without fbgemm: as it is, checked. (Not rerun
    on the emulated AVX2 CPU: 15 s there, for a kernel that AVX2 machines run only with DTYPE=bfloat16.)"""
    model = build_tiny_model(len(tiny_tokenizer))
    quantize_linears(model, "int8", kernel="weight_only", batch_invariant=True)
    assert "weight-only int8, " in make_linears_invariant(model, torch.float32)
    for name, layer in first_layer_and_head(model).items():
        assert rows_differ_from_alone(layer, layer.in_features) == [], name


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
        assert "computes a row differently depending on the call's row count" in caplog.text
        for name, layer in layers.items():
            assert rows_differ_from_alone(layer, layer.in_features) == [], name


def test_a_packed_fp32_copy_that_is_not_invariant_is_dropped_for_f_linear(tiny_dir, monkeypatch, caplog):
    """oneDNN's packed copy, made variant here (within rounding, so it passes the closeness check): every shape
    falls back to F.linear (whole, in tiles or per row, as this CPU's MKL allows) and keeps no copy."""
    real = batch_rows.packed_linear
    monkeypatch.setattr(batch_rows, "packed_linear",
                        lambda x, w, b: real(x, w, b) * (1 + 1e-7 * (x.numel() // x.shape[-1])))
    with caplog.at_level(logging.INFO, logger="app.models.batch_rows"):
        lm = load_model(str(tiny_dir), device="cpu", dtype="float32", batch_invariant="on")
    assert ("packed fp32 linear (400 x 64) computes a row differently depending on the call's row count "
            "(first seen at 1 rows)") in caplog.text
    assert lm.prepack == ("off: oneDNN's packed fp32 kernel did not compute a row the same way at every row count "
                          "here (BATCH_INVARIANT)")
    assert "F.linear fp32" in lm.invariance and "oneDNN packed" not in lm.invariance
    for name, layer in linears(lm.model).items():
        assert isinstance(layer, BatchRowsLinear) and layer.packed_weight is None and layer.invariant[0] == "plain"
        assert rows_differ_from_alone(layer, layer.in_features) == [], name


def test_bf16_prepacking_takes_the_fastest_way_of_calling_whose_kernel_is_invariant(monkeypatch):
    """Native-bf16 CPUs cannot be run everywhere: a stand-in packed kernel that is variant with hint 1 and invariant
    with hint 8 (fp32 oneDNN's own behaviour on a Zen 2) is packed with 8 in whole calls; one variant at every row
    count under both hints, in fixed tiles (where plain F.linear would go in tiles anyway: the Zen 5's 896 x 4864
    shape); one whose row also depends on its place in the call stays plain, and PREPACK's state says why. Loading
    checks only the ways this CPU's bf16 may take (tiles, where bf16 is native)."""
    from app.models import loading
    from app.models.invariance import invariant_splits

    class FakePacked(nn.Module):
        def __init__(self, linear, batch_hint=1):
            super().__init__()
            self.in_features, self.out_features, self.hint = linear.in_features, linear.out_features, batch_hint
            self.weight, self.bias = linear.weight, linear.bias

        def forward(self, x):  # one F.linear per row, invariant; then the injected fault
            rows = x.reshape(-1, self.in_features)
            out = torch.cat([F.linear(row[None], self.weight, self.bias) for row in rows])
            if self.hint in variant:
                out = out * (1 + 1e-6 * fault(len(rows)))  # within rounding: prepacking keeps it
            return out.reshape(*x.shape[:-1], self.out_features)

    by_count, by_place = (lambda n: n), (lambda n: torch.arange(n)[:, None])
    monkeypatch.setattr(prepack, "PackedLinear", FakePacked)
    for variant, fault, expected in (({1}, by_count, (8, "whole")), ({1, 8}, by_count, (1, "tiles")),
                                     ({1, 8}, by_place, None)):
        model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 16))
        assert set(prepack.invariant_hints(model, splits=("whole", "tiles")).values()) == {expected}
        cpu_splits = invariant_splits(torch.bfloat16, torch.device("cpu"))
        here = set(prepack.invariant_hints(model, splits=cpu_splits).values())
        state = loading._pack_bf16(model, "true", invariant=True)
        if expected:
            assert state == "on: 2 linear layers" and len(here) == 1
            assert all((m.hint, m.invariant_split) in here for m in model)
        else:
            assert "its kernel computed a row differently at different row counts" in state
            assert all(type(m) is nn.Linear for m in model)


def test_a_large_lm_head_is_checked_at_fewer_row_counts_to_keep_the_load_short():
    """Fewer, but every count up to its widest: a wider call goes in calls of that many (test_invariance_holes.py)."""
    assert row_check.rows_to_check(896, 4864) == ROWS  # every body shape of the default model: all of them
    assert row_check.rows_to_check(896, 151_936) == (1, 2, 3, 4, 5, 6, 7, 8)  # its lm_head: reading it is the cost
    assert row_check.rows_to_check(3584, 152_064) == (1, 2, 3)  # a 7B's: the least there is


def test_use_batch_rows_plans_each_shape_once(monkeypatch):
    plans = []
    real = batch_rows.invariant_plan
    monkeypatch.setattr(batch_rows, "invariant_plan", lambda layer: plans.append(layer) or real(layer))
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(4, 6))
    assert use_batch_rows(model, packed=True, invariant=True) == 3
    assert len(plans) == 2 and all(m.invariant is not None for m in model)


def test_bf16_runs_in_fixed_tiles_where_the_cpu_multiplies_bf16_natively(tiny_tokenizer, monkeypatch):
    """On an AMX Xeon, oneDNN's bf16 kernel passed the check's row counts and still differed at others (65, 200
    rows), and a served model differed under load: there every bf16 call is a fixed tile of TILE_ROWS rows, a
    call the check covers whole. Where bf16 is not native (a Zen 3, by its flags) whole calls stay, as checked.
    The rows are compared with the rows alone under the flags of this machine's own class only: told it is a Zen 3,
    an AMX Xeon still runs its AMX kernel, whose whole calls vary at row counts a check's one probe may not meet
    (seen here: rows of a 64-row call of the tiny o_proj)."""
    from app.models import cpu, invariance
    from cpu_flags import ZEN3_FLAGS

    native_here = cpu.cpu_features().native_bf16 is not None

    for flags, expected in ((SAPPHIRE_RAPIDS_FLAGS, {"tiles"}), (ZEN3_FLAGS, {"whole"})):
        monkeypatch.setattr(invariance, "cpu_features", lambda flags=flags: cpu.features_from_cpuinfo(flags))
        model = build_tiny_model(len(tiny_tokenizer)).to(torch.bfloat16)
        make_linears_invariant(model, torch.bfloat16)
        layers = first_layer_and_head(model)
        assert {getattr(m, "split", "whole") for m in layers.values()} == expected
        if native_here == (expected == {"tiles"}):
            for name, layer in layers.items():
                assert rows_differ_from_alone(layer, layer.in_features, torch.bfloat16) == [], name


def test_auto_is_on_for_a_cpu_in_fp32_and_off_where_its_cost_is_unmeasured(tiny_dir):
    """BATCH_INVARIANT=auto as an operator meets it: a CPU server in fp32 loads invariant, and the start log's reason
    says so; with QUANT, bf16, compiled decode steps, tensor parallelism or CUDA it stays off and names why."""
    from app.models.invariance import resolve_batch_invariant

    lm = load_model(str(tiny_dir), device="cpu", dtype="float32")  # batch_invariant's default: auto
    assert lm.batch_invariant and lm.invariance.startswith("auto: on")
    cpu = torch.device("cpu")
    for why, kwargs in {"QUANT=int8": dict(quant="int8"), "bfloat16": dict(dtype=torch.bfloat16),
                        "DECODE_STEP=compiled": dict(decode_step="compiled"), "tensor parallelism": dict(sharded=True),
                        "cuda": dict(device=torch.device("cuda"))}.items():
        on, reason = resolve_batch_invariant("auto", **{"device": cpu, **kwargs})
        assert not on and why in reason, (why, reason)
    assert resolve_batch_invariant("on", torch.device("cuda"), quant="int4") == (True, "BATCH_INVARIANT=on")
    assert resolve_batch_invariant("off", cpu) == (False, "BATCH_INVARIANT=off")


def test_auto_is_off_in_fp32_where_the_packed_copies_are_not_made(tiny_dir, monkeypatch):
    """Without PREPACK's fp32 copies (PREPACK=false, or too little RAM, as a 3B model on a 23 GiB machine) every
    linear would run in tiles of 8 rows, a one-stream step's cost several times over: auto stays off and says why;
    `on` still pays it."""
    from app.models import loading

    lm = load_model(str(tiny_dir), device="cpu", dtype="float32", prepack="false")
    assert not lm.batch_invariant and lm.invariance == ("auto: off, since PREPACK=false (the linears would run in "
                                                        "tiles of 8 rows)")
    monkeypatch.setattr(loading, "FP32_COPY_RAM_FRACTION", 0.0)  # no RAM to spare for the copies
    lm = load_model(str(tiny_dir), device="cpu", dtype="float32")
    assert not lm.batch_invariant and "more than half the" in lm.invariance and lm.prepack.startswith("off: fp32 copies")
    assert load_model(str(tiny_dir), device="cpu", dtype="float32", batch_invariant="on").batch_invariant
