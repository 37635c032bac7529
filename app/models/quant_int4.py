"""`QUANT=int4`: the decoder's linear layers read 4-bit weights, group-wise affine (group INT4_GROUP). Two kernels:
our own (app/models/int4_decode.py, INT4_KERNEL=auto: int8 activations times the 4-bit codes in integers, on
AVX512-VNNI or AVX2), and torch's `aten._weight_int4pack_mm_for_cpu` (INT4_KERNEL=aten, and wherever ours cannot
build or run), whose kernel follows ATen's CPU capability by itself and takes bf16 activations, its fast path
(fp32 ones measured 20x slower). A layer holds the weights once, in the layout of the kernel it runs.
aten's kernel reads the weights again for every row, so on an AMX Xeon a bf16 copy of the same 4-bit weights for
calls of more than Int4Linear.DECODE_ROWS rows took the first token from 508 to 159 ms and 8 streams from 54 to 95
tok/s (docs/performance.md). But the copy holds 2 bytes a weight beside the 4-bit ones: int4 then held more than
bf16 itself (a Zen 4's RSS: 3,533 MiB against the defaults' 1,827), which is the memory a user picks int4 to save.
So the copy is opt-in (INT4_WIDE_COPY, off by default; the start log states its bytes) and only where the CPU
multiplies bf16 natively (AVX512_BF16, AMX).
The lm_head stays int8: torch's int4 kernel took 9.7 ms on its 151,936 x 896 weight for one row, dynamic int8 6.1
ms (Zen 3).
Where torch's kernel is missing (CUDA here, a torch without it) the model gets int8 instead, and the log says so.
Each group's smallest and largest weight are its codes 0 and 15, as in a Q4_1 or Q4_K block, so a GGUF block
that uses both ends (SmolLM2's Q4_1 weights) comes back with the same codes (tests/fast/test_quant.py). The
embedded Qwen's "Q4_K_M" is mostly Q5_0, Q6_K and Q8_0, which 4 bits round: 4-8% weight error (docs/performance.md).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn import functional as F

from app.models.cpu import cpu_features
from app.models.int4_decode import Int4Kernel, fp16_scales

INT4_GROUP = 32  # a Q4_K sub-block's size; the retired `benchmarks kernels --group-sizes` (at deca0b0) measured others
QUANTIZE_ROWS = 512  # rows of a weight quantized at a time: each op's fp32 temporaries are this many rows, not all


def int4_weight(weight: torch.Tensor, group: int, dequantize: bool = False) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor | None]:
    """[out, in] float -> (4-bit codes as int32 [out, in], scales_and_zeros [in / group, out, 2], the dequantized
    weight where asked for, else None): per group of `group` input weights, the smallest maps to code 0 and the
    largest to 15, as a Q4_K sub-block's scale and minimum do. The kernel computes (code - 8) x scale + zero.
    QUANTIZE_ROWS rows at a time (each row's groups are its own): whole, a 3B shape's 11,008 x 2,048 linear took
    ~400 MB of fp32 temporaries at once, the load's peak above what it keeps."""
    out_f, in_f = weight.shape
    codes = torch.empty(out_f, in_f, dtype=torch.int32, device=weight.device)
    scales_and_zeros = torch.empty(in_f // group, out_f, 2, dtype=torch.float32, device=weight.device)
    dequantized = torch.empty(out_f, in_f, dtype=torch.float32, device=weight.device) if dequantize else None
    for start in range(0, out_f, QUANTIZE_ROWS):
        rows = slice(start, min(start + QUANTIZE_ROWS, out_f))
        groups = weight[rows].detach().float().reshape(-1, in_f // group, group)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=1e-12)
        chunk = torch.round((groups - low) / scale).clamp_(0, 15)
        if dequantized is not None:
            dequantized[rows] = (chunk * scale + low).reshape(-1, in_f)
        codes[rows] = chunk.reshape(-1, in_f)
        scales_and_zeros[:, rows] = torch.stack([scale.squeeze(-1).t(), (low + 8 * scale).squeeze(-1).t()], dim=-1)
    return codes, scales_and_zeros, dequantized


def int4_kernel_missing(device: torch.device) -> str | None:
    """Why `Int4Linear` cannot run here, or None."""
    if device.type != "cpu":
        return f"torch's int4 kernel for {device.type} is not wired in here"
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return f"torch {torch.__version__} has no _weight_int4pack_mm_for_cpu"
    return None


class Int4Linear(nn.Module):
    """Drop-in `nn.Linear` (CPU): 4-bit weights in groups of `group` inputs, packed for `kernel` (ours, an
    `Int4Kernel` of app/models/int4_decode.py, at any row count), else for aten's int4 CPU kernel.

    aten's kernel reads the weights again for every row: its time grows with the rows (AMX Xeon, one 4864 x 896
    layer: 0.11 ms at 1 row, 0.41 at 8, 6.3 at 128, where bf16 took 0.32, 0.35 and 0.66). With `wide_bf16`
    (INT4_WIDE_COPY), calls of more than DECODE_ROWS rows (prefill chunks, decode steps of many streams) multiply
    `wide`: the same 4-bit weights, dequantized once to bf16 (and prepacked for oneDNN where it can), on the CPU's
    native bf16 matmul. Both paths compute bf16 activations times the same weights. The copy costs 2 bytes a
    weight (`copy_bytes`), four times the 4-bit weights; a decode step of a few streams never reads it.
    """

    # At most this many rows go to the int4 kernel. On the AMX Xeon a lone layer ran faster on the prepacked copy from
    # 8 rows on; served, 8 streams: 95.0 tok/s with 4 here against 90.3 with 8 (docs/performance.md).
    DECODE_ROWS = 4
    wide_packed = False

    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP, wide_bf16: bool = False,
                 quantized: tuple[torch.Tensor, torch.Tensor] | None = None, kernel: Int4Kernel | None = None):
        """`quantized`: (codes int32 [out, in], scales_and_zeros [in / group, out, 2]) made already (a GGUF's own
        4-bit blocks, app/models/gguf_blocks.py); `linear.weight` is then not read (it may be on the meta device).
        `kernel`: ours where it is one of int4_decode.cpp's paths (groups of 32 only); None or aten: aten's."""
        super().__init__()
        self.in_features, self.out_features, self.group = linear.in_features, linear.out_features, group
        codes, scales_and_zeros = quantized if quantized is not None else int4_weight(linear.weight, group)[:2]
        self.kernel = kernel if kernel is not None and kernel.ours and group == INT4_GROUP else None
        if self.kernel is not None:  # codes, fp16 scales and minimums in one uint8 buffer; no aten layout beside it
            scale, minimum = fp16_scales(scales_and_zeros)
            self.register_buffer("packed", self.kernel.pack(codes, scale, minimum))
            self.weight_bytes = self.packed.numel()
        else:
            scales_and_zeros = scales_and_zeros.to(torch.bfloat16)
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
            self.register_buffer("scales_and_zeros", scales_and_zeros)
            self.weight_bytes = self.packed.numel() * self.packed.element_size() + scales_and_zeros.numel() * 2
        self.bias = linear.bias
        # Not a parameter or buffer: app/models/prepack.py decode_bytes_per_step leaves it out, as a step does.
        self.wide: torch.Tensor | None = None
        self.copy_bytes = 0
        if wide_bf16 and self.kernel is not None:  # the weights ours multiplies: code x scale + minimum, fp16 both
            self.wide = (codes * scale.float().repeat_interleave(group, dim=1)
                         + minimum.float().repeat_interleave(group, dim=1)).to(torch.bfloat16)
        elif wide_bf16:  # what aten's kernel computes, (code - 8) x scale + zero, with its bf16 scales and zeros
            scale, zero = scales_and_zeros.float().transpose(0, 1).repeat_interleave(group, dim=1).unbind(-1)
            self.wide = ((codes - 8) * scale + zero).to(torch.bfloat16)
        if wide_bf16:
            if cpu_features().bf16_reorder:  # oneDNN's blocked layout, as PREPACK does: 1.1-2.3x at 8-128 rows here
                with contextlib.suppress(RuntimeError):  # oneDNN refused: the copy stays plain (app/models/prepack.py)
                    self.wide, self.wide_packed = torch.ops.mkldnn._reorder_linear_weight(self.wide, 1), True
            self.copy_bytes = self.in_features * self.out_features * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in], any float dtype -> the same dtype
        rows = x.reshape(-1, self.in_features)
        if self.wide is not None and rows.shape[0] > self.DECODE_ROWS:
            rows = rows.to(torch.bfloat16)
            out = (torch.ops.mkldnn._linear_pointwise(rows, self.wide, None, "none", [], "") if self.wide_packed
                   else F.linear(rows, self.wide))
        elif self.kernel is not None:  # fp32 or bf16 as they come: the kernel quantizes them to int8 itself
            out = self.kernel.matmul(rows if rows.dtype in (torch.float32, torch.bfloat16) else rows.float(),
                                     self.packed, self.out_features)
        else:
            rows = rows.to(torch.bfloat16)
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scales_and_zeros)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group={self.group}, kernel={self.kernel.name if self.kernel else 'aten'}, "
                f"wide={'bf16' if self.wide is not None else 'off'}")
