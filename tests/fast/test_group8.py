"""A GGUF's 5- to 8-bit blocks served from their own codes (app/models/gguf_blocks.py's `group8_from_blocks`,
app/models/quant_group8.py, int8_groups.h): each type's codes and scales give gguf's own dequantized weights back,
every kernel path this CPU runs gives the plain C++ reference's bits, a row the same bits at any row count, and
QUANT=auto on a GGUF serves such tensors so, with the start log saying which."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from torch import nn

from app.models import int4_decode
from app.models.gguf_blocks import GROUP8_BYTES, group8_from_blocks
from app.models.gguf_load import stream_gguf
from app.models.int4_decode import PATHS, choose_int4_kernel
from app.models.quant_group8 import GroupInt8Linear
from conftest import build_tiny_model
from test_gguf_blocks import reference_weights, write_tiny_gguf

TYPES = [T.Q8_0, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K]


def random_blocks(qtype: T, rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """[rows, bytes] of `qtype`: gguf's own quantizer where it has one, else random bytes (every bit of the layout
    in play) with fp16 d (and dmin) set to a weight's scale."""
    rng = np.random.default_rng(seed)
    if qtype in (T.Q8_0, T.Q5_0, T.Q5_1):
        return quantize((rng.standard_normal((rows, columns)) * 0.05).astype(np.float32), qtype)
    blocks = rng.integers(0, 256, (rows * columns // 256, GROUP8_BYTES[qtype]), dtype=np.uint8)
    d = (rng.uniform(0.5, 2, (len(blocks), 2)) * 1e-3).astype(np.float16).view(np.uint8)
    if qtype == T.Q5_K:
        blocks[:, :4] = d
    else:  # Q6_K: d last
        blocks[:, 208:210] = d[:, :2]
    return blocks.reshape(rows, -1)


def weights_of(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """[out, in] float32: what the kernel multiplies, code x scale + minimum."""
    return (codes.float() * scale.float().repeat_interleave(16, dim=1)
            + minimum.float().repeat_interleave(32, dim=1))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_block_type_keeps_its_codes_and_only_its_scales_round_to_fp16(qtype):
    raw = random_blocks(qtype, 24, 512)
    reference = torch.from_numpy(dequantize(raw, qtype))
    codes, scale, minimum = group8_from_blocks(raw, qtype, rows_at_once=7)  # slices that do not divide the rows
    ours = weights_of(codes, scale, minimum)
    # fp16 keeps 11 significant bits: a scale d x sc_j (Q5_K, Q6_K) and Q5_K's minimum round by at most 2^-11
    magnitude = ((codes.float() * scale.float().repeat_interleave(16, dim=1)).abs()
                 + minimum.float().abs().repeat_interleave(32, dim=1))
    error = ((ours - reference).abs() / magnitude.clamp(min=1e-12)).max().item()
    print(f"{qtype.name}: largest error {error:.2e} of |code x scale| + |minimum|")
    if qtype in (T.Q8_0, T.Q5_0, T.Q5_1):  # d and m are fp16 in the file: exact
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-9)
    assert error <= 2 ** -11


def test_the_rows_follow_the_models_order_where_transformers_reorders_them():
    raw = random_blocks(T.Q6_K, 16, 256)
    order = np.random.default_rng(3).permutation(16)
    moved, plain = group8_from_blocks(raw, T.Q6_K, order), group8_from_blocks(raw, T.Q6_K)
    assert all(torch.equal(a, b[order]) for a, b in zip(moved, plain))


@pytest.fixture(scope="module")
def reference():
    kernel = choose_int4_kernel("reference")
    assert kernel.ours, f"the int4 kernel's extension does not build here: {kernel.why}"
    return kernel


def random_layer(rows: int = 40, columns: int = 96, seed: int = 0):
    """Codes over the whole int8 range (-128 included: AVX2 reads its magnitude as 128), scales and minimums."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (rows, columns), generator=gen, dtype=torch.int8)
    scale = (torch.rand(rows, columns // 16, generator=gen) * 1e-2 + 1e-3).half()
    minimum = (torch.randn(rows, columns // 32, generator=gen) * 1e-2).half()
    return codes, scale, minimum


def quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activations in float32 as it computes them: per block of 32, d = amax / 127, q = rint(x / d)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(blocks * inv), d


def test_the_reference_is_float64_of_the_same_quantized_math(reference):
    codes, scale, minimum = random_layer()
    packed = reference.pack8(codes, scale, minimum)
    x = torch.randn(5, 96)
    out = reference.matmul8(x, packed, 40).double()
    q, d = quantized_rows(x)
    w = weights_of(codes, scale, minimum).double()  # code x scale + minimum, exact in float64
    exact = (q.double() * d.double()).reshape(5, 96) @ w.t()
    terms = (q.double() * d.double()).reshape(5, 96).abs() @ w.abs().t()
    bound = (2 * 3 + 4) * 2 ** -24 * terms  # three fp32 steps per group of 32, three groups
    assert ((out - exact).abs() <= bound).all(), ((out - exact).abs() / terms).max()


def runnable_paths() -> list:
    module, why = int4_decode.extension()
    return [pytest.param(name, marks=pytest.mark.skipif(module is None or not module.supported(PATHS[name]),
                                                        reason=why or f"this CPU has no {name}"))
            for name in ("vnni", "avx2")]


@pytest.mark.parametrize("path", runnable_paths())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_path_gives_the_reference_bits_and_a_row_the_same_bits_at_any_row_count(reference, path, dtype):
    codes, scale, minimum = random_layer(rows=40, columns=160)  # a ragged last tile, five groups
    kernel = choose_int4_kernel(path)
    layer = GroupInt8Linear(nn.Linear(160, 40, bias=False, device="meta"), codes, scale, minimum, kernel)
    x = torch.randn(9, 160).to(dtype)
    expected = reference.matmul8(x, reference.pack8(codes, scale, minimum), 40)
    assert torch.equal(layer(x), expected)
    for rows in (1, 2, 3, 5):
        assert torch.equal(layer(x[:rows]), expected[:rows]), rows
    assert torch.equal(layer(x[4:5]), expected[4:5])


def test_quant_auto_serves_a_ggufs_5_to_8_bit_linears_from_their_own_codes(tmp_path, caplog, reference):
    model = build_tiny_model(400, arch="llama")  # hidden 64, intermediate 128: 256-weight blocks fit no row
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, model, {"attn_q": T.Q5_0, "attn_k": T.Q5_1, "attn_v": T.Q8_0, "attn_output": T.Q4_1,
                                  "ffn_gate": T.Q5_0, "ffn_up": T.Q8_0, "ffn_down": T.Q5_1, "output": T.Q8_0})
    with caplog.at_level(logging.INFO, logger="app.models.gguf_load"):
        served = stream_gguf(path, model.config, torch.float32, "int4", torch.float32, own_bits_only=True)
    line = next(r.getMessage() for r in caplog.records if r.name == "app.models.gguf_load")
    assert "kept their own blocks' codes (2 Q4_1, 4 Q5_0, 4 Q5_1, 4 Q8_0)" in line, line
    assert "1 Q8_0: the lm_head reads int8" in line, line
    weights = reference_weights(path, model)
    eye = torch.eye(64)  # one 1.0 per row: its int8 activation is exactly 127 x (1 / 127)
    for name, module in served.named_modules():
        if name.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            assert isinstance(module, GroupInt8Linear), name
            torch.testing.assert_close(module(eye).t(), weights[f"{name}.weight"], rtol=1e-5, atol=1e-6)


def test_where_the_int4_kernel_cannot_run_such_blocks_become_int8_rows_and_the_log_says_why(tmp_path, caplog,
                                                                                            monkeypatch):
    from app.models import quant
    from app.models.int4_decode import Int4Kernel
    from app.models.quant import DynamicInt8Linear, WeightOnlyInt8Linear

    monkeypatch.setattr(quant, "choose_int4_kernel", lambda asked="auto": Int4Kernel("aten", "no compiler here"))
    model = build_tiny_model(400, arch="llama")
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, model, {"attn_q": T.Q4_0, "attn_k": T.Q4_0, "attn_v": T.Q8_0, "attn_output": T.Q4_0,
                                  "ffn_gate": T.Q4_0, "ffn_up": T.Q4_0, "ffn_down": T.Q5_0,
                                  "output": T.Q8_0})
    with caplog.at_level(logging.INFO, logger="app.models.gguf_load"):
        served = stream_gguf(path, model.config, torch.float32, "int4", torch.float32, own_bits_only=True)
    assert not any(isinstance(m, GroupInt8Linear) for m in served.modules())
    assert all(isinstance(m, (DynamicInt8Linear, WeightOnlyInt8Linear))
               for name, m in served.named_modules() if name.endswith(("v_proj", "down_proj")))
    line = next(r.getMessage() for r in caplog.records if r.name == "app.models.gguf_load")
    assert ("2 Q5_0: 8-bit groups need our int4 kernel, which cannot run here (no compiler here): dequantized, "
            "then int8 per output channel") in line, line
