"""llama.cpp's blocks as our groups, code for code (4-bit ones as QUANT=int4's, 5- to 8-bit ones as 8-bit
groups): a GGUF served from its own bits, not rounded twice.

Why: dequantizing a GGUF to floats and quantizing those again (what a GGUF went through before) rounds each weight
twice. Q4_0, Q4_1 and Q4_K hold 32 weights per (sub-)block as 4-bit codes with one affine map, and that is
exactly what an `Int4Linear` group of INT4_GROUP = 32 holds (app/models/quant_int4.py): the kernel computes
(code - 8) x scale + zero per group. So each block maps onto one group with the same codes:
  Q4_0  w = d (q - 8)                       scale = d,         zero = 0
  Q4_1  w = d q + m                         scale = d,         zero = m + 8 d
  Q4_K  w = d sc_j q - dmin m_j (sub-block j of a 256-weight super-block, 6-bit sc_j and m_j)
                                            scale = d sc_j,    zero = 8 d sc_j - dmin m_j
The codes are exact; only the scale and zero round, once, to the kernel's scale dtype, bf16 (it refuses fp32
scales with bf16 activations): llama.cpp's fp16 d, dmin and m keep 11 significant bits, bf16 8, so a weight moves by
at most 2^-8 (half a bf16 ulp) of |scale (q - 8)| + |zero|. Against gguf's own dequantize, the largest error of a
weight as a share of its block's range: 2.5e-3 (Q4_0), 2.3e-3 (Q4_1), 2.2e-3 (Q4_K) on normal random weights
(tests/fast/test_gguf_blocks.py); a Q4_K sub-block whose minimum lies far off zero moves by more of its own range.

Q5_0, Q5_1, Q5_K, Q6_K and Q8_0 map onto `GroupInt8Linear` (app/models/quant_group8.py) the same way: signed codes
of at most 8 bits, a scale per 16 weights and a minimum per 32, w = code x scale + minimum:
  Q8_0  w = d q                    code = q,        scale = d
  Q5_0  w = d (q - 16)             code = q - 16,   scale = d
  Q5_1  w = d q + m                code = q,        scale = d,       minimum = m
  Q5_K  w = d sc_j q - dmin m_j    code = q,        scale = d sc_j,  minimum = -dmin m_j   (sub-blocks of 32)
  Q6_K  w = d sc_j (q - 32)        code = q - 32,   scale = d sc_j                         (sub-blocks of 16)
The codes are recovered from gguf's own dequantize (weight minus minimum, over the scale, rounded: exact, as the
scale and minimum are the block's). The scales and minimums are stored in fp16, llama.cpp's own d's width: Q8_0's,
Q5_0's and Q5_1's are exact; a product d sc_j (Q5_K, Q6_K) rounds once, by at most 2^-11 of itself.
Every other type (Q2_K, Q3_K, IQ*) and any tensor whose width is not a multiple of 32 keeps the dequantized path
(app/models/gguf_load.py says which tensors took which path).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K

BLOCK_BYTES = {T.Q4_0: 18, T.Q4_1: 20, T.Q4_K: 144}  # bytes per block: 32, 32 and 256 weights
BLOCK_WEIGHTS = {T.Q4_0: 32, T.Q4_1: 32, T.Q4_K: 256}
OWN_BLOCK_TYPES = frozenset(BLOCK_BYTES)
GROUP8_BYTES = {T.Q8_0: 34, T.Q5_0: 22, T.Q5_1: 24, T.Q5_K: 176, T.Q6_K: 210}  # per block of 32 or 256 weights
GROUP8_TYPES = frozenset(GROUP8_BYTES)


def _f16(column: np.ndarray) -> np.ndarray:
    """A block's 2-byte fp16 field -> float32, one per block."""
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32).reshape(-1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles are the first 16 weights, the high ones the next 16."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def block_codes(raw: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGUF tensor's data ([rows, bytes per row] uint8, rows = out_features) -> (codes uint8 [rows, in],
    scale float32 [rows, in / 32], zero float32 [rows, in / 32]), where weight = (code - 8) x scale + zero."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, BLOCK_BYTES[qtype])
    if qtype == T.Q4_0:  # d fp16, 16 bytes of codes
        scale = _f16(blocks[:, 0:2])
        codes, zero = _nibbles(blocks[:, 2:]), np.zeros_like(scale)
    elif qtype == T.Q4_1:  # d fp16, m fp16, 16 bytes of codes
        scale, low = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        codes, zero = _nibbles(blocks[:, 4:]), low + 8 * scale
    elif qtype == T.Q4_K:  # d fp16, dmin fp16, 12 bytes of 6-bit (sc, m) x 8, 128 bytes of codes
        d, dmin = _f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None]
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])  # [blocks, 8] each
        # 4 chunks of 32 bytes: chunk c's low nibbles are sub-block 2c, its high nibbles sub-block 2c + 1
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        codes = (qs & 0x0F).reshape(-1, 32)
        scale = (d * sc.astype(np.float32)).reshape(-1)
        zero = (8 * scale.reshape(-1, 8) - dmin * m.astype(np.float32)).reshape(-1)
    else:
        raise ValueError(f"{qtype.name} blocks do not map onto 4-bit groups here")
    return codes.reshape(rows, -1), scale.reshape(rows, -1), zero.reshape(rows, -1)


def _group8_fields(blocks: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray]:
    """A type's scale per 16 weights and minimum per 32, float32, [blocks, weights / 16] and [blocks, weights / 32]."""
    if qtype in (T.Q8_0, T.Q5_0, T.Q5_1):
        d = _f16(blocks[:, 0:2])[:, None]
        minimum = _f16(blocks[:, 2:4])[:, None] if qtype == T.Q5_1 else np.zeros_like(d)
        return np.repeat(d, 2, axis=1), minimum
    if qtype == T.Q5_K:  # d, dmin, the 12 bytes of 6-bit (sc, m) x 8 as Q4_K's
        d, dmin = _f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None]
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
        return np.repeat(d * sc.astype(np.float32), 2, axis=1), -dmin * m.astype(np.float32)
    # Q6_K: 128 bytes of low bits, 64 of high bits, 16 int8 scales, d
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    return _f16(blocks[:, 208:210])[:, None] * sc, np.zeros((blocks.shape[0], 8), dtype=np.float32)


def group8_from_blocks(raw: np.ndarray, qtype: T, row_order: np.ndarray | None = None, rows_at_once: int = 512
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `GroupInt8Linear` takes: (codes int8 [out, in], scale fp16 [out, in / 16], minimum fp16 [out, in / 32]),
    from a GGUF tensor's data ([rows, bytes per row] uint8), `rows_at_once` rows at a time (the float32 weights of
    a 7B's widest layer would take ~270 MB at once). `row_order` as `int4_from_blocks`."""
    from gguf import dequantize

    rows = raw.shape[0]
    codes, scales, minimums = [], [], []
    for start in range(0, rows, rows_at_once):
        part = np.ascontiguousarray(raw[start:start + rows_at_once])
        weights = dequantize(part, qtype).reshape(-1, 16)
        scale, minimum = _group8_fields(part.reshape(-1, GROUP8_BYTES[qtype]), qtype)
        scale, minimum = scale.reshape(-1), minimum.reshape(-1)
        shifted = weights - np.repeat(minimum, 2)[:, None]
        code = np.rint(np.divide(shifted, scale[:, None], out=np.zeros_like(shifted), where=scale[:, None] != 0))
        codes.append(np.clip(code, -128, 127).astype(np.int8).reshape(part.shape[0], -1))
        scales.append(scale.reshape(part.shape[0], -1))
        minimums.append(minimum.reshape(part.shape[0], -1))
    code, scale, minimum = np.concatenate(codes), np.concatenate(scales), np.concatenate(minimums)
    if row_order is not None:
        code, scale, minimum = code[row_order], scale[row_order], minimum[row_order]
    return (torch.from_numpy(np.ascontiguousarray(code)), torch.from_numpy(scale).half(),
            torch.from_numpy(minimum).half())


def int4_from_blocks(raw: np.ndarray, qtype: T, row_order: np.ndarray | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """What `Int4Linear(..., quantized=...)` takes: (codes int32 [out, in], scales_and_zeros bf16 [in / 32, out, 2]).
    `row_order`: the output rows' order in the model, where it differs from the file's (llama.cpp permutes a
    LLaMA's q and k rows; transformers' LlamaTensorProcessor puts them back)."""
    codes, scale, zero = block_codes(raw, qtype)
    if row_order is not None:
        codes, scale, zero = codes[row_order], scale[row_order], zero[row_order]
    scales_and_zeros = torch.stack([torch.from_numpy(scale).t(), torch.from_numpy(zero).t()], dim=-1)
    return torch.from_numpy(codes.astype(np.int32)), scales_and_zeros.to(torch.bfloat16).contiguous()


def dequantized(codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int = 32) -> torch.Tensor:
    """[out, in] float32: what the int4 kernel multiplies, (code - 8) x scale + zero with its bf16 scales."""
    scale, zero = scales_and_zeros.float().transpose(0, 1).repeat_interleave(group, dim=1).unbind(-1)
    return (codes - 8) * scale + zero
