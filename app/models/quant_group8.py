"""A GGUF linear in 5- to 8-bit blocks (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) served from its own codes: `GroupInt8Linear`.

Why: rounding such a block's weights again to int8 per output channel (what QUANT=auto did before) moves each
weight onto a grid of the whole row's range, a second rounding on top of the file's. Every one of these blocks is
signed codes of at most 8 bits with a scale per 16 or 32 weights (and for Q5_1 and Q5_K a minimum per 32), so the
codes are kept as they are and only the scales round, once, to fp16 (app/models/gguf_blocks.py says by how much).
The int4 kernel's extension multiplies them (int8_groups.h): activations quantized to int8 per block of 32 as for
4-bit weights and as llama.cpp does for these types, integer dot products, fp32 sums in a fixed order, so the row
count never changes a row's bits (BATCH_INVARIANT holds).

The layout holds 9.5 bits a weight (an 8-bit code, an fp16 scale per 16 and a minimum per 32): more than a Q5_0's
5.5 or a Q6_K's 6.56, 1.5 more than the int8 rows it replaces. Where the int4 kernel cannot run (no compiler, not
x86), the loader keeps the int8 rows instead (app/models/gguf_load.py).
"""

from __future__ import annotations

import torch
from torch import nn

from app.models.int4_decode import Int4Kernel
from app.models.quant_int4 import INT4_GROUP

GROUP8 = INT4_GROUP  # inputs per minimum (scales per 16): the activations' blocks of 32, as for 4-bit weights


class GroupInt8Linear(nn.Module):
    """Drop-in `nn.Linear` (CPU): `codes` int8 [out, in], `scale` [out, in / 16], `minimum` [out, in / 32], a weight
    being code x scale + minimum, packed once for `kernel` (one of int4_decode.cpp's paths)."""

    def __init__(self, linear: nn.Linear, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                 kernel: Int4Kernel):
        super().__init__()
        if not kernel.ours:
            raise ValueError(f"GroupInt8Linear needs our int4 kernel's extension, not {kernel.name}")
        self.in_features, self.out_features, self.kernel = linear.in_features, linear.out_features, kernel
        if codes.shape != (self.out_features, self.in_features) or self.in_features % GROUP8:
            raise ValueError(f"codes {tuple(codes.shape)} do not fit a {self.in_features} -> {self.out_features} "
                             f"linear in groups of {GROUP8}")
        self.register_buffer("packed", kernel.pack8(codes.to(torch.int8), scale.half(), minimum.half()))
        self.weight_bytes = self.packed.numel()
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in], any float dtype -> the same dtype
        rows = x.reshape(-1, self.in_features)
        out = self.kernel.matmul8(rows if rows.dtype in (torch.float32, torch.bfloat16) else rows.float(),
                                  self.packed, self.out_features).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"kernel={self.kernel.name}")
