"""What a loaded model's weights hold in memory, by format: the start log, /metrics and /v1/models report it.

A user picks QUANT=int4 to fit a bigger model into the memory they have, so what each format holds must be seen,
not assumed: a bf16 copy beside 4-bit weights (INT4_WIDE_COPY), torch's oneDNN int8 packing that keeps the int8
original too, or PREPACK's fp32 copies for batched rows each cost as much as a format of their own, and are reported
apart as `copies`. Counted once per storage, so a tied lm_head and its embedding table count once.

Formats: the linear layers' weights as `fp32`, `bf16`, `fp16`, `int8` or `int4` (scales and zeros included); the
input `embeddings` table; `copies`; `other` (norms, biases, rotary tables).
"""

from __future__ import annotations

import torch
from torch import nn

from app.models.batch_rows import BatchRowsLinear
from app.models.prepack import PackedLinear
from app.models.quant import DynamicInt8Linear, WeightOnlyInt8Linear
from app.models.quant_group8 import GroupInt8Linear
from app.models.quant_int4 import Int4Linear
from app.models.quant_embedding import Int8Embedding

FORMATS = ("fp32", "bf16", "fp16", "int8", "int4", "embeddings", "copies", "other")
FLOAT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def weight_bytes_by_format(model: nn.Module) -> dict[str, int]:
    """Bytes of every format in FORMATS (0 where none)."""
    out = dict.fromkeys(FORMATS, 0)
    seen: set[int] = set()

    def add(key: str, tensor: torch.Tensor | None) -> None:
        if tensor is None or tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out[key] += storage.nbytes()

    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(embedding, Int8Embedding):  # quantized; a tied int8 lm_head reads the same rows (counted here)
        add("embeddings", embedding.codes)
        add("embeddings", embedding.scales)
    elif embedding is not None:
        add("embeddings", embedding.weight)
    for module in model.modules():
        if module is embedding:
            continue
        if isinstance(module, Int4Linear):
            out["int4"] += module.weight_bytes
            out["copies"] += module.copy_bytes
        elif isinstance(module, GroupInt8Linear):
            out["int8"] += module.weight_bytes
        elif isinstance(module, DynamicInt8Linear):
            out["int8"] += module.weight_bytes
            out["copies"] += module.copy_bytes
        elif isinstance(module, WeightOnlyInt8Linear):
            add("int8", module.weight_int8)
            add("int8", module.scales)
        elif isinstance(module, PackedLinear):
            out[FLOAT_NAMES.get(module.packed_weight.dtype, "other")] += module.weight_bytes
        elif isinstance(module, (nn.Linear, BatchRowsLinear)):
            add(FLOAT_NAMES.get(module.weight.dtype, "other"), module.weight)
            if getattr(module, "packed_weight", None) is not None:
                out["copies"] += module.weight.numel() * module.weight.element_size()
        else:
            for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
                add("other", tensor)
            continue
        bias = getattr(module, "bias", None)  # a linear's bias: small, with the norms
        if isinstance(bias, torch.Tensor):
            add("other", bias)
    return out


def describe(by_format: dict[str, int]) -> str:
    """`int4 179.6 MiB, int8 129.9 MiB, embeddings 259.8 MiB, other 0.4 MiB; no copies`, for the start log."""
    held = [f"{name} {by_format[name] / 2**20:,.1f} MiB" for name in FORMATS if name != "copies" and by_format[name]]
    copies = by_format["copies"]
    return (", ".join(held) or "none") + (f"; copies {copies / 2**20:,.1f} MiB" if copies else "; no copies")
