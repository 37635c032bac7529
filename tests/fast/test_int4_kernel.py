"""QUANT=int4's own kernel (app/models/int4_decode.py, int4_decode.cpp): every path this CPU can run (an AVX-512 CPU
runs the AVX2 one too) against the plain C++ reference, bit for bit; the reference against float64 of the same
quantized math, within fp32 rounding; a row the same at any row count; the served tiny model's tokens; and the
fallback to aten's kernel where ours cannot build.

The paths are exact to one another by construction: each group's integer sum is exact, and its two fp32 steps
(scale_w x scale_x x sum, then + min_w x scale_x x sum(q)) run in the same order everywhere. Against float64 of the
same int8 activations and fp16 scales, the fp32 result differs by at most a few roundings per group: the bound
below is (2 x groups + 4) units of 2^-24 of the sum of the terms' magnitudes. The first test in a session builds
the extension (about 40 s with g++ 12 on the Zen 4 here; cached in ~/.cache/simple-serve/kernels/ after).
"""

from __future__ import annotations

import copy
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
from torch import nn

from app.models import int4_decode
from app.models.int4_decode import PATHS, choose_int4_kernel, fp16_scales
from app.models.quant import quantize_linears
from app.models.quant_int4 import INT4_GROUP, Int4Linear, int4_kernel_missing, int4_weight

from conftest import build_tiny_model
from test_quant import PROMPTS, greedy

REPO = Path(__file__).resolve().parents[2]
SHAPES = [(64, 16), (96, 40), (896, 128)]  # (in, out): one tile, a ragged last tile, a real layer's k/v shape
ROWS = [1, 2, 3, 5, 8, 17]


@pytest.fixture(scope="module")
def reference():
    kernel = choose_int4_kernel("reference")  # plain C++: builds wherever `make test` runs (g++ and ninja)
    assert kernel.ours, f"our int4 kernel does not build here: {kernel.why}"
    return kernel


def runnable_paths() -> list:
    """Each fast path as a param, skipped with its reason where this CPU lacks its instructions."""
    module, why = int4_decode.extension()
    return [pytest.param(name, marks=pytest.mark.skipif(module is None or not module.supported(PATHS[name]),
                                                        reason=why or f"this CPU has no {name}"))
            for name in ("vnni", "avx2")]


def layer(in_f: int, out_f: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, fp16 scale, fp16 minimum) of a random layer, as Int4Linear makes them."""
    weight = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed))
    codes, scales_and_zeros, _ = int4_weight(weight, INT4_GROUP)
    return (codes, *fp16_scales(scales_and_zeros))


@pytest.mark.parametrize("path", runnable_paths())
def test_each_path_gives_the_reference_bits(reference, path):
    kernel = choose_int4_kernel(path)
    assert kernel.name == path, kernel.why
    for in_f, out_f in SHAPES:
        packed = reference.pack(*layer(in_f, out_f))
        for rows in ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(rows, in_f, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype)
                got, want = kernel.matmul(x, packed, out_f), reference.matmul(x, packed, out_f)
                assert got.dtype == dtype and torch.equal(got, want), (path, in_f, out_f, rows, dtype)


def test_the_reference_is_float64_of_the_same_quantized_math(reference):
    """Activations quantized as the kernel does (per block of 32: d = max|x| / 127, q = x / d rounded to even),
    then everything in float64: the kernel's fp32 answer is within a few fp32 roundings per group of it. A single
    activation rounded the other way would be off by a whole weight x d, far beyond the bound."""
    for in_f, out_f in SHAPES:
        codes, scale, minimum = layer(in_f, out_f, seed=1)
        packed = reference.pack(codes, scale, minimum)
        x = torch.randn(5, in_f, generator=torch.Generator().manual_seed(2))
        x[0, :INT4_GROUP] = 0  # an all-zero block: d = 0, q = 0
        blocks = x.reshape(5, -1, INT4_GROUP)
        d = blocks.abs().amax(-1, keepdim=True) / 127  # fp32, as the kernel
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.round(blocks * inv)  # torch.round: half to even, as nearbyintf
        sums = torch.einsum("ngk,mgk->mng", codes.reshape(out_f, -1, INT4_GROUP).double(), q.double())
        scaled = scale.double()[None] * d.squeeze(-1).double()[:, None] * sums
        offsets = minimum.double()[None] * (d.squeeze(-1).double() * q.sum(-1).double())[:, None]
        want = (scaled + offsets).sum(-1)
        bound = (2 * (in_f // INT4_GROUP) + 4) * 2.0**-24 * (scaled.abs() + offsets.abs()).sum(-1)
        got = reference.matmul(x, packed, out_f).double()
        assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())


@pytest.mark.parametrize("path", ["reference", *runnable_paths()])
def test_int4_linear_on_each_path_computes_a_row_alike_at_any_row_count_and_stays_near_float(reference, path):
    """What BATCH_INVARIANT's row check asks (app/models/invariance.py): a row of an M-row call is that row
    alone, bit for bit; and the layer is within int8 activations' rounding of float on its own 4-bit weights
    (measured 0.4-0.7% relative error on these shapes, against aten's bf16 activations' ~0.3%)."""
    torch.manual_seed(0)
    linear = nn.Linear(4 * INT4_GROUP, 48)  # aten packs 16 outputs at a time
    ours, aten = Int4Linear(linear, kernel=choose_int4_kernel(path)), Int4Linear(linear)
    assert ours.kernel.name == path and aten.kernel is None and ours.weight_bytes == aten.weight_bytes
    x = torch.randn(17, 4 * INT4_GROUP)
    with torch.inference_mode():
        alone = torch.cat([ours(row[None]) for row in x])
        for rows in ROWS:
            assert torch.equal(ours(x[:rows]), alone[:rows]), rows
        codes, scales_and_zeros, _ = int4_weight(linear.weight, INT4_GROUP)
        scale, minimum = (t.float().repeat_interleave(INT4_GROUP, 1) for t in fp16_scales(scales_and_zeros))
        exact = x @ (codes * scale + minimum).t() + linear.bias  # float on the weights ours holds
        for layer_ in (ours, aten):
            assert ((layer_(x) - exact).norm() / exact.norm()).item() < 0.02


@pytest.mark.skipif(int4_kernel_missing(torch.device("cpu")) is not None, reason="no int4 CPU kernel in this torch")
def test_the_tiny_model_under_int4_agrees_with_the_unquantized_one_as_often_as_on_aten_s_kernel(reference,
                                                                                                 tiny_tokenizer):
    """The served model under QUANT=int4, on our kernel (auto) and on aten's: 16 greedy tokens of the unquantized
    model per prompt, teacher-forced, agree at >= 80% on each (test_quant.py's bound; measured 43 and 44 of 48 on
    ours and aten's here), and the decode loop runs."""
    plain = build_tiny_model(len(tiny_tokenizer))
    agreement = {}
    for int4_kernel in ("auto", "aten"):
        quantized = copy.deepcopy(plain)
        quantize_linears(quantized, "int4", int4_kernel=int4_kernel)
        kinds = {m.kernel.name if m.kernel else "aten" for m in quantized.modules() if isinstance(m, Int4Linear)}
        assert kinds == {choose_int4_kernel(int4_kernel).name}
        agree = total = 0
        for text in PROMPTS:
            ids = tiny_tokenizer.encode(text)
            want = greedy(plain, tiny_tokenizer, ids)
            with torch.inference_mode():
                logits = quantized(torch.tensor([ids + want])).logits[0, len(ids) - 1:-1]
            agree += int((logits.argmax(-1) == torch.tensor(want)).sum())
            total += len(want)
        agreement[int4_kernel] = agree / total
        assert len(greedy(quantized, tiny_tokenizer, ids)) == 16
    print(agreement)
    assert min(agreement.values()) >= 0.8, agreement


def test_where_the_kernel_cannot_build_int4_runs_on_aten_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(int4_decode, "extension", lambda: (None, "int4_decode.cpp could not be built (no g++)"))
    choose_int4_kernel.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="app.models.int4_decode"):
            kernel = choose_int4_kernel("auto")
        assert kernel.name == "aten" and "no g++" in kernel.why and "aten's int4 kernel instead" in caplog.text
        assert Int4Linear(nn.Linear(64, 16), kernel=kernel).kernel is None
        assert choose_int4_kernel("aten").why == "INT4_KERNEL=aten"
        with pytest.raises(ValueError, match="int4_kernel must be one of"):
            choose_int4_kernel("amx")
    finally:
        choose_int4_kernel.cache_clear()


def test_the_kernel_source_ships_in_the_wheel():
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["app"]
    for path in (int4_decode.SOURCE, *int4_decode.INCLUDES):
        source = path.relative_to(REPO / "app").as_posix()
        assert any(fnmatch(source, pattern) for pattern in patterns), source
