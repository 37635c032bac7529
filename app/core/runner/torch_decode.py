"""The torch version of decode attention on a CPU: one query row per request as two fp32 matmuls. Our C++ kernel
(app/models/decode_attention.py) replaces it where it is built; BATCH_INVARIANT's calls and the compiled step's
KV pool keep it."""

from __future__ import annotations

import torch


def decode_matmuls(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode rows take `grouped_decode_attention` instead of SDPA: on a CPU in half precision."""
    return device.type == "cpu" and dtype != torch.float32


def grouped_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                             scaling: float) -> torch.Tensor:
    """One query per request, grouped-query attention as two fp32 matmuls: q [B, heads, 1, d], k and v
    [B, kv_heads, width, d] fp32, additive mask [B, 1, 1, width] fp32 (None: every key seen) -> [B, heads, d] fp32.

    Why: torch's CPU SDPA is slow for one bf16 query over a long cache (measured 29 of a 54 ms decode step at
    2,000 tokens). Each KV head serves its group of query heads without repeating its keys.
    Not bit-identical to bf16 SDPA: scores and softmax are computed in fp32 from the same bf16 inputs, so this is
    the more precise of the two; tests/fast/test_decode_attention.py bounds the difference.
    """
    batch, kv_heads, _, dim = k.shape
    grouped = q.reshape(batch, kv_heads, -1, dim).float()  # [B, kv_heads, groups, d]: heads h*g..h*g+g-1 share h
    scores = torch.matmul(grouped, k.transpose(-1, -2)).mul_(scaling)  # [B, kv_heads, groups, width]
    if mask is not None:
        scores.add_(mask)
    return torch.matmul(scores.softmax(-1), v).reshape(batch, -1, v.shape[-1])  # d_v: MLA's differs from d
