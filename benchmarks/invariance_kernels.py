"""`python -m benchmarks invariance --kernels`: which kernels compute a row the same way at any row count, here.

The server's invariant path (app/models/invariance.py) checks its own candidates at load; this lists them all side by
side, on this CPU and torch, with their speed, so a reader can see why the load-time check chose what it chose, and
what another CPU class would get. For each kernel, on one 4864 x 896 layer (Qwen2.5-0.5B's MLP up projection):
row 0 and the last row of calls of 1 to 200 rows against the same row alone, bit for bit, then ms per call at 1, 8
and 128 rows. Then SDPA: a prompt's attention in 16-token pieces against 32-, 64- and 128-token chunks. Where CUDA
is present, its fp32 and bf16 linears too.

What it found (docs/performance.md keeps the table): on a Zen 2 (AVX2, torch 2.13) fp32 oneDNN packed with batch
hint 8 is invariant and fp32 MKL is not; on an AMX Xeon (torch 2.11) fp32 packed is not, bf16 F.linear and bf16
packed with hint 1 are; the int8 kernels with a fixed activation range and the int4 kernel are everywhere it ran.
"""

from __future__ import annotations

import time
import warnings
from typing import Callable

import torch
from torch.nn import functional as F

ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 65, 129, 200)
OUT_FEATURES, IN_FEATURES, INT4_GROUP = 4864, 896, 32


def differing_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> list[int]:
    """The row counts at which row 0, or the call's last row, differs from that row computed alone."""
    first = fn(x[:1])
    return [m for m in ROWS if not (torch.equal(fn(x[:m])[0], first[0])
                                    and torch.equal(fn(x[:m])[m - 1], fn(x[m - 1 : m])[0]))]


def ms_per_call(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, repeat: int = 20) -> dict[str, float]:
    times = {}
    for m in (1, 8, 128):
        fn(x[:m])
        start = time.perf_counter()
        for _ in range(repeat):
            fn(x[:m])
        times[f"{m} rows"] = round((time.perf_counter() - start) / repeat * 1e3, 3)
    return times


def anchored_int8(packed, reduce_range: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """Dynamic int8 with the activation range fixed: rows divided by their peak, one [+1, -1, 0...] row appended."""
    def run(x: torch.Tensor) -> torch.Tensor:
        peak = x.abs().amax(-1, keepdim=True)
        anchor = x.new_zeros(1, x.shape[1])
        anchor[0, 0], anchor[0, 1] = 1, -1
        return torch.ops.quantized.linear_dynamic(torch.cat([x / peak, anchor]), packed, reduce_range)[:-1] * peak
    return run


def candidates(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """name -> a kernel computing x @ weight.T in some form; refused kernels are left out (with a note)."""
    kernels: dict[str, Callable] = {"fp32 F.linear (MKL)": lambda x: F.linear(x, weight)}
    bf16 = weight.bfloat16()
    kernels["bf16 F.linear"] = lambda x: F.linear(x.bfloat16(), bf16)
    for dtype, w in (("fp32", weight), ("bf16", bf16)):
        for hint in (1, 8):
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(w, hint)
            except RuntimeError:
                continue  # oneDNN refuses bf16 packing without avx512bw/vl/dq or avx_ne_convert
            kernels[f"{dtype} oneDNN packed, hint {hint}"] = (
                lambda x, p=packed, d=w.dtype: torch.ops.mkldnn._linear_pointwise(x.to(d), p, None, "none", [], ""))
    scales = weight.abs().amax(1) / 127
    int8 = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    kernels["int8 weight-only, fp32 activations"] = lambda x: torch.ops.aten._weight_int8pack_mm(x, int8, scales)
    kernels["int8 weight-only, bf16 activations"] = (
        lambda x: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), int8, scales.bfloat16()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for engine in (e for e in ("fbgemm", "onednn") if e in torch.backends.quantized.supported_engines):
            torch.backends.quantized.engine = engine
            q = torch._make_per_channel_quantized_tensor(int8, scales.double(), torch.zeros_like(scales, dtype=torch.long), 0)
            packed = torch.ops.quantized.linear_prepack(q, None)
            kernels[f"int8 dynamic ({engine}), range per call"] = (
                lambda x, p=packed: torch.ops.quantized.linear_dynamic(x, p, True))
            kernels[f"int8 dynamic ({engine}), fixed range"] = anchored_int8(packed, True)
    if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        from app.models.quant_int4 import int4_weight

        codes, scales_and_zeros, _ = int4_weight(weight, INT4_GROUP)
        packed4, sz = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), scales_and_zeros.bfloat16()
        kernels["int4 (aten, bf16 activations)"] = (
            lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed4, INT4_GROUP, sz))
    return kernels


def sdpa_pieces_equal_chunks(dtype: torch.dtype, length: int = 320) -> dict[str, bool]:
    """Whether a prompt's attention in 16-token pieces equals it in chunks of 32, 64 and 128 tokens, bit for bit."""
    q, k, v = (torch.randn(1, heads, length, 64, dtype=dtype) for heads in (14, 2, 2))

    def chunked(size: int) -> torch.Tensor:
        out = []
        for start in range(0, length, size):
            end = min(start + size, length)
            mask = torch.ones(end - start, end, dtype=torch.bool).tril(start)[None, None]
            out.append(F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end],
                                                      attn_mask=mask, enable_gqa=True))
        return torch.cat(out, 2)

    pieces = chunked(16)
    return {f"{size}-token chunks": torch.equal(chunked(size), pieces) for size in (32, 64, 128)}


@torch.inference_mode()
def measure() -> dict:
    torch.manual_seed(0)
    weight, x = torch.randn(OUT_FEATURES, IN_FEATURES), torch.randn(max(ROWS), IN_FEATURES)
    report: dict = {"threads": torch.get_num_threads(), "kernels": {}, "sdpa": {}}
    for name, fn in candidates(weight).items():
        try:
            report["kernels"][name] = {"differs_at_rows": differing_rows(fn, x), "ms_per_call": ms_per_call(fn, x)}
        except RuntimeError as err:
            report["kernels"][name] = {"error": str(err)[:200]}
    for dtype in (torch.float32, torch.bfloat16):
        report["sdpa"][str(dtype).removeprefix("torch.")] = sdpa_pieces_equal_chunks(dtype)
    if torch.cuda.is_available():
        report["cuda"] = {"device": torch.cuda.get_device_name()}
        for dtype in (torch.float32, torch.bfloat16):
            w, xs = weight.cuda().to(dtype), x.cuda().to(dtype)
            report["cuda"][f"{str(dtype).removeprefix('torch.')} F.linear"] = differing_rows(
                lambda rows, w=w: F.linear(rows, w), xs)
    return report


def print_report(report: dict) -> None:
    print(f"{'kernel':<42}{'row-invariant?':<36}{'ms at 1 / 8 / 128 rows':>24}")
    for name, r in report["kernels"].items():
        if "error" in r:
            print(f"{name:<42}error: {r['error'][:60]}")
            continue
        verdict = "yes" if not r["differs_at_rows"] else f"no: differs at {r['differs_at_rows'][:6]}"
        print(f"{name:<42}{verdict:<36}{' / '.join(f'{v:.3f}' for v in r['ms_per_call'].values()):>24}")
    for dtype, checks in report["sdpa"].items():
        print(f"SDPA {dtype}: 16-token pieces equal " + ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in checks.items()))
    for name, rows in report.get("cuda", {}).items():
        if name != "device":
            print(f"CUDA {name}: {'row-invariant' if not rows else f'differs at {rows[:6]}'}")
