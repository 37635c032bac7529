"""Load a GGUF file's chat model tensor by tensor, as app/models/streamed_load.py loads safetensors: built on the
meta device, each linear quantized as it arrives; with QUANT=int4, a linear stored in Q4_0, Q4_1 or Q4_K blocks
keeps its own codes (app/models/gguf_blocks.py) instead of being dequantized and rounded to 4 bits again.

QUANT=auto, the default, is for a GGUF file the setting that keeps each tensor's own bits (`own_bits_only`): a linear
in 4-bit blocks keeps its codes as int4; one in 5-, 6- or 8-bit blocks (most of a "Q4_K_M" file: Q5_0, Q6_K, Q8_0)
keeps its codes too, as 8-bit groups (`GroupInt8Linear`, on the int4 kernel's extension); where that extension cannot
run, and for a linear in floats, the weights are dequantized and rounded to int8 per output channel, never down
to 4 bits. The file's quality at its size is what the user chose; QUANT=int4 still rounds every
decoder linear to 4 bits, QUANT=none serves the dequantized floats.

Every other tensor is dequantized by gguf's own numpy code, put back in the model's row order by transformers' own
tensor processor (a LLaMA's q and k rows), cast to the load dtype and quantized (QUANT) as before. The start log
says how many linears kept their own bits and which tensors were converted, by type and why.

Only architectures whose transformers processor at most reorders rows (the base one and LLaMA's) load here; others
(MoE experts split or merged, reshaped Bloom heads, ...) load through from_pretrained as before (NotStreamable).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from app.models.gguf_blocks import GROUP8_TYPES, OWN_BLOCK_TYPES, group8_from_blocks, int4_from_blocks
from app.models.quant import LinearQuantizer, finish_quantizing, quantize_table, tied_head
from app.models.quant_group8 import GROUP8, GroupInt8Linear
from app.models.quant_int4 import INT4_GROUP
from app.models.meta_fill import (READ_CHUNK, NotStreamable, complete_linear, give_back_freed, init_buffers,
                                  match_names, places_of, put)

log = logging.getLogger("app.models.gguf_load")

FLOAT_TYPES = ("F32", "F16", "BF16")
DEQUANTIZE_ROWS = 4096  # a 7B's widest row (18,944) in float32 with gguf's temporaries: a few hundred MB at most


def stream_gguf(path: Path, config, load_dtype: torch.dtype, quant: str = "none", dtype: torch.dtype | None = None,
                quant_options: dict | None = None, own_bits_only: bool = False) -> nn.Module:
    """`config`'s model with the weights of the GGUF file at `path`; with `quant`, each linear quantized as it
    arrives, a 4-bit block's linear from its own codes under QUANT=int4. Raises NotStreamable before reading any
    weight where the file's tensors do not match the model built from `config`."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, LlamaTensorProcessor, TensorProcessor,
                                                          get_gguf_hf_weights_map)

    reader = GGUFReader(path)
    arch_field = reader.fields["general.architecture"]
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    processor_class = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    if processor_class not in (TensorProcessor, LlamaTensorProcessor):
        raise NotStreamable(f"transformers converts a GGUF {arch}'s tensors with {processor_class.__name__}")
    processor = processor_class(config=config.to_dict())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=load_dtype)
    if getattr(model, "_keep_in_fp32_modules", None) or getattr(model, "_keep_in_fp32_modules_strict", None):
        raise NotStreamable(f"{type(model).__name__} keeps some modules in fp32")
    to_hf = get_gguf_hf_weights_map(model, processor)
    tensors = {to_hf[t.name]: t for t in reader.tensors if t.name in to_hf}  # as transformers: others are skipped
    places = places_of(model)
    names = match_names(model, places, {path: ({n: {"shape": list(reversed([int(d) for d in t.shape]))}
                                           for n, t in tensors.items()}, 0)})
    quantizer = (LinearQuantizer(model, quant, dtype=dtype, device=torch.device("cpu"), **(quant_options or {}))
                 if quant != "none" else None)
    parents = {id(child): (parent, name) for parent in model.modules() for name, child in parent.named_children()}
    keep_whole, embedding = tied_head(model), model.get_input_embeddings()
    kept: Counter[str] = Counter()
    converted: Counter[tuple[str, str]] = Counter()

    def linear_weight(name: str) -> bool:
        module, attr = places[name][0]
        return type(module) is nn.Linear and attr == "weight"

    # Biases and norms first: a linear is complete, and quantized, when its weight arrives.
    order = sorted(names, key=lambda n: (linear_weight(n), tensors[n].data_offset))
    with torch.no_grad(), open(path, "rb", buffering=0) as file:
        for name in order:
            entry, qtype = tensors[name], tensors[name].tensor_type
            raw = _read(file, entry)
            module, attr = places[name][0]
            grouped = (quantizer is not None and linear_weight(name) and module is not quantizer.head  # a decoder
                       and module is not keep_whole and module.in_features % INT4_GROUP == 0)  # linear, in groups
            own_bits = grouped and quantizer.int4 is not None and qtype in OWN_BLOCK_TYPES
            eight_bits = (grouped and own_bits_only and qtype in GROUP8_TYPES  # GROUP8 is INT4_GROUP
                          and quantizer.int4_kernel is not None and quantizer.int4_kernel.ours)
            if own_bits or eight_bits:
                order_of_rows = _row_order(processor, entry.name, module.out_features)
                parent, child = parents[id(module)]
                setattr(parent, child, quantizer.int4(module, quantized=int4_from_blocks(raw, qtype, order_of_rows))
                        if own_bits else GroupInt8Linear(module, *group8_from_blocks(raw, qtype, order_of_rows),
                                                         kernel=quantizer.int4_kernel))
                places.pop(name).clear()
                kept[qtype.name] += 1
                del module, raw
                give_back_freed()
                continue
            if qtype.name not in FLOAT_TYPES:
                converted[(qtype.name, _why_converted(module, linear_weight(name), quantizer, qtype, keep_whole,
                                                      embedding, own_bits_only))] += 1
            tensor = _dequantized(raw, qtype, entry, processor, load_dtype)
            del raw
            module = put(places.pop(name), tensor)
            if quantizer is not None and module is embedding:
                quantize_table(model, quantizer)
                embedding = keep_whole = None
            elif quantizer is not None and complete_linear(module) and module is not keep_whole:
                parent, child = parents[id(module)]  # QUANT=auto: never fewer bits than the file's (docstring)
                setattr(parent, child, quantizer.leftover(module) if own_bits_only else quantizer(module))
                module.weight = None
            del module, tensor
            give_back_freed()
    del parents, places, keep_whole, embedding, reader
    init_buffers(model)
    if meta := [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]:
        raise NotStreamable(f"{len(meta)} tensors were not in the file ({meta[0]}, ...)")
    if quantizer is not None:
        finish_quantizing(model, quantizer)
    log.info("GGUF %s: %d linear layers kept their own blocks' codes (%s); converted: %s", path.name,
             sum(kept.values()), _counts(kept) or "none",
             "; ".join(f"{count} {qtype}: {why}" for (qtype, why), count in sorted(converted.items())) or "none")
    return model


def _read(file, entry) -> np.ndarray:
    """A tensor's bytes, read into memory of its own, as [rows, bytes per row] uint8 (gguf's dequantize takes
    that for every type)."""
    data = np.empty(int(entry.n_bytes), dtype=np.uint8)
    view, done = memoryview(data), 0
    file.seek(entry.data_offset)
    while done < data.size:
        if not (got := file.readinto(view[done:done + READ_CHUNK])):
            raise NotStreamable(f"the file ends inside {entry.name}")
        done += got
    rows = int(np.prod([int(d) for d in entry.shape[1:]], dtype=np.int64)) if len(entry.shape) > 1 else 1
    return data.reshape(rows, -1)


def _dequantized(raw: np.ndarray, qtype, entry, processor, load_dtype: torch.dtype) -> torch.Tensor:
    """A tensor's values in `load_dtype`, in the model's row order. A matrix is dequantized DEQUANTIZE_ROWS rows at
    a time into its `load_dtype` tensor: gguf's dequantize of a whole table holds the float32 values and several
    temporaries of that size (the embedded Qwen's 151,936 x 896 Q5_0 table: 0.5 GB of float32 alone, on a model
    that keeps 0.1 GB of it), which made the load's peak about twice what stays."""
    from gguf import dequantize

    shape = list(reversed(entry.shape.tolist()))
    if len(shape) != 2:  # norms and biases: small; the processor's own code, as transformers runs it
        values = processor.process(weights=dequantize(raw, qtype), name=entry.name).weights
        return torch.from_numpy(np.ascontiguousarray(values).reshape(shape)).to(load_dtype)
    tensor = torch.empty(shape, dtype=load_dtype)
    for start in range(0, shape[0], DEQUANTIZE_ROWS):
        tensor[start:start + DEQUANTIZE_ROWS] = torch.from_numpy(dequantize(raw[start:start + DEQUANTIZE_ROWS], qtype))
    order = _row_order(processor, entry.name, shape[0])
    return tensor if order is None else tensor[torch.from_numpy(order)]


def _row_order(processor, gguf_name: str, rows: int) -> np.ndarray | None:
    """Where the processor moves the output rows (a LLaMA's q and k): its own reordering, applied to row numbers."""
    moved = processor.process(weights=np.arange(rows, dtype=np.int64).reshape(rows, 1), name=gguf_name).weights
    moved = moved.reshape(rows)
    return None if np.array_equal(moved, np.arange(rows)) else moved


def _why_converted(module: nn.Module, is_linear_weight: bool, quantizer: LinearQuantizer | None, qtype,
                   keep_whole: nn.Module | None, embedding: nn.Module | None, own_bits_only: bool = False) -> str:
    if quantizer is None:
        return "dequantized to floats (QUANT=none)"
    if module is embedding or module is keep_whole:
        return "the embedding table (and a tied lm_head): dequantized, then int8 rows"
    if not is_linear_weight:
        return "not a linear's weight: dequantized to floats"
    if module is quantizer.head:
        return "the lm_head reads int8: dequantized, then int8"
    if quantizer.int4 is None:
        return "QUANT=int8: dequantized, then int8"
    if qtype in OWN_BLOCK_TYPES:
        return f"input width not a multiple of {INT4_GROUP}: dequantized, then int8"
    if own_bits_only and qtype not in GROUP8_TYPES:
        return "no 8-bit groups map its blocks: dequantized, then int8 per output channel (never down to 4 bits)"
    if own_bits_only and not quantizer.int4_kernel.ours:  # QUANT=int4 from here on: its kernel was chosen
        return (f"8-bit groups need our int4 kernel, which cannot run here ({quantizer.int4_kernel.why}): "
                "dequantized, then int8 per output channel")
    if own_bits_only:
        return f"input width not a multiple of {GROUP8}: dequantized, then int8 per output channel"
    return "no 4-bit groups map its blocks yet: dequantized, then rounded to int4 groups"


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{count} {name}" for name, count in sorted(counter.items()))
