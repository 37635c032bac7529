"""Load a chat model's weights in the memory it runs in: built on the meta device, filled tensor by tensor from its
safetensors files, each linear quantized (QUANT) as soon as its weight and bias are in, its source dropped.

Why: `from_pretrained` builds the whole model in the load dtype first, and QUANT then replaced the linears, so the
load peaked at the full-precision model plus the quantized one. On a Zen 4 at the 0.5B shape the peak (VmHWM) was
2.40x the resident memory after one answer with the defaults, 3.35x with QUANT=int8, 4.20x with QUANT=int4.
Streamed, at most one linear exists in full precision beside the quantized ones (and the embedding table, which
QUANT turns into int8 rows at the end, as a tied lm_head needs it whole): vLLM's streaming online quantization and
ipex-llm's stream-convert do the same.

Each tensor is read with plain reads into memory of its own, not through a mapping of the file: a mapped file's
pages count in the process's resident memory (and its peak) for as long as the mapping lives, which was most of
the old peak with QUANT. The values are those `from_pretrained` gives: each float cast to the load dtype, ties kept,
non-persistent buffers (rotary frequencies) computed by the model's own `_init_weights`, the same quantizer applied
(tests/fast/test_streamed_load.py compares the two, tensor by tensor). Anything else loads as before, with a log
line that says why: tensor parallelism, a GGUF file of an architecture app/models/gguf_load.py does not take
(transformers dequantizes it), a device other than the CPU, no safetensors files, names or shapes that transformers
would convert, modules kept in fp32. A GGUF file streams through app/models/gguf_load.py, its 4-bit blocks kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.errors import ConfigError
from app.models.fetch import EMBEDDED, fetch_model
from app.models.meta_fill import (READ_CHUNK, NotStreamable, complete_linear, give_back_freed, init_buffers,
                                    match_names, places_of, put)
from app.models.quant import LinearQuantizer, finish_quantizing, quantize_linears, quantize_table, tied_head

log = logging.getLogger("app.models.streamed_load")

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


def load_weights(source: str, kwargs: dict[str, Any], config, device: torch.device, dtype: torch.dtype,
                 quant: str, quant_options: dict[str, Any]) -> nn.Module:
    """The model, quantized where `quant` says (`quant_options`: quantize_linears' wide_copy and batch_invariant),
    streamed where it can be, else through from_pretrained."""
    from transformers import AutoModelForCausalLM

    own_bits = quant_options.pop("own_bits", False)  # QUANT=auto on a GGUF (app/models/gguf_load.py)
    load_dtype = load_dtype_for(config, dtype, quant)
    if load_dtype != dtype:
        log.info("loading in %s, the checkpoint's dtype: QUANT=%s quantizes the linears from it, so loading "
                 "peaks at the checkpoint's size, not %s's", str(load_dtype).removeprefix("torch."), quant,
                 str(dtype).removeprefix("torch."))
    try:
        if kwargs.get("gguf_file") and device.type == "cpu":  # its own 4-bit blocks kept (app/models/gguf_load.py)
            from app.models.gguf_load import stream_gguf
            model = stream_gguf(Path(source) / kwargs["gguf_file"], config, load_dtype, quant, dtype, quant_options,
                                own_bits)
            log.info("weights streamed from the GGUF file, tensor by tensor%s",
                     f", each linear quantized as it arrived (QUANT={quant})" if quant != "none" else "")
            return model
        model = stream_model(_local_dir(source, kwargs, device), config, load_dtype, quant, dtype, quant_options)
        log.info("weights streamed from the safetensors files, tensor by tensor%s",
                 f", each linear quantized as it arrived (QUANT={quant})" if quant != "none" else "")
        return model
    except NotStreamable as why:
        log.info("weights loaded by from_pretrained, not streamed: %s", why)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=load_dtype, device_map=device, **kwargs)
    if quant != "none":  # every linear, lm_head included; QUANT=auto's never below the file's bits: int8
        quantize_linears(model, "int8" if own_bits else quant, dtype=dtype, **quant_options)
    return model


def resolve_quant(quant: str, name_or_path: str, device: torch.device, tensor_parallel: int) -> tuple[str, bool]:
    """QUANT=auto -> (the mode, whether a GGUF's tensors keep their own bits): a GGUF file served on a CPU by one
    process keeps its 4-bit blocks as int4 and takes int8 for the rest (app/models/gguf_load.py), so the load is
    QUANT=int4's with that one difference; anything else loads unquantized, as QUANT=none."""
    if quant != "auto":
        return quant, False
    if Path(name_or_path).suffix == ".gguf" and device.type == "cpu" and tensor_parallel == 1:
        log.info("QUANT=auto: a GGUF file keeps its own bits: 4-bit blocks as int4, 5- to 8-bit ones as int8")
        return "int4", True
    return "none", False


def locate(name_or_path: str, cache_dir: Path) -> tuple[str, dict[str, Any]]:
    """Where from_pretrained should look, and with which extra arguments (`load_weights` streams from there where it
    can)."""
    if name_or_path in EMBEDDED:
        return str(fetch_model(name_or_path, cache_dir)), {}
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConfigError(f"GGUF file not found: {path}", param="model")
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path} is a directory but has no config.json", param="model")
        return str(path), {}
    if name_or_path.startswith(("/", "./", "../", "~")) or path.exists() or name_or_path.count("/") != 1:
        raise ConfigError(f"model path not found: {name_or_path} (nor is it an embedded model name: "
                          f"{', '.join(EMBEDDED)}; a hub id looks like org/name)", param="model")
    return name_or_path, {}  # a hub id such as Qwen/Qwen2.5-7B-Instruct


def load_dtype_for(config, dtype: torch.dtype, quant: str) -> torch.dtype:
    """What to load the weights in: `dtype`, except where QUANT will replace the linears and the checkpoint holds
    them narrower (a bf16 checkpoint, served in fp32 for the dynamic int8 kernels). Then its own dtype: loaded in
    fp32, a 7B model would first take 30 GB for weights that quantizing brings to 8 (int8) or 5 (int4); loaded in
    bf16 it peaks at 15, the file's size. The linears are quantized from the same values either way, and the
    floats left are widened after (app/models/quant.py `quantize_linears`), so the model is the same, bit for bit
    (tests/fast/test_quant.py)."""
    stored = getattr(config, "dtype", None)
    stored = getattr(torch, stored, None) if isinstance(stored, str) else stored
    if quant == "none" or not isinstance(stored, torch.dtype) or not stored.is_floating_point:
        return dtype
    return stored if stored.itemsize < dtype.itemsize else dtype


def _local_dir(source: str, kwargs: dict[str, Any], device: torch.device) -> Path:
    """The directory that holds the safetensors files: a local one, or a hub id's download (huggingface_hub's cache,
    as from_pretrained would fill it)."""
    if kwargs.get("gguf_file"):
        raise NotStreamable("a GGUF file (transformers dequantizes it while loading)")
    if device.type != "cpu":
        raise NotStreamable(f"the streamed load fills CPU memory, and the device is {device.type}")
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download
    try:  # what from_pretrained downloads of a safetensors checkpoint, no more
        return Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as err:  # noqa: BLE001  no hub, no such id: from_pretrained then says why in its own words
        raise NotStreamable(f"could not download {source!r} ahead of the load ({type(err).__name__})") from err


def stream_model(directory: Path, config, load_dtype: torch.dtype, quant: str = "none",
                 dtype: torch.dtype | None = None, quant_options: dict[str, Any] | None = None) -> nn.Module:
    """`config`'s model with the weights of `directory`'s safetensors files, in `load_dtype`; with `quant`, each
    linear quantized for `dtype` (the dtype it runs in) as it arrives. Raises NotStreamable before reading any
    weight when the files do not match the model built from `config` name for name and shape for shape."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    headers = {shard: _header(shard) for shard in _shards(directory)}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=load_dtype)
    if getattr(model, "_keep_in_fp32_modules", None) or getattr(model, "_keep_in_fp32_modules_strict", None):
        raise NotStreamable(f"{type(model).__name__} keeps some modules in fp32")
    places = places_of(model)
    names = match_names(model, places, headers)
    quantizer = (LinearQuantizer(model, quant, dtype=dtype, device=torch.device("cpu"), **(quant_options or {}))
                 if quant != "none" else None)
    parents = {id(child): (parent, name) for parent in model.modules() for name, child in parent.named_children()}
    keep_whole, embedding = tied_head(model), model.get_input_embeddings()  # a tied head: with the table
    with torch.no_grad():
        for shard, (entries, start) in headers.items():
            with open(shard, "rb", buffering=0) as file:
                for name in sorted(names & entries.keys(), key=lambda n: entries[n]["data_offsets"][0]):
                    tensor = _read(file, start, entries[name])
                    if tensor.is_floating_point():  # from_pretrained casts every float to the load dtype
                        tensor = tensor.to(load_dtype)
                    module = put(places.pop(name), tensor)
                    if quantizer is not None and module is embedding:  # int8 rows now, a tied head's too
                        del tensor  # held by the table alone, which quantize_table may free early
                        quantize_table(model, quantizer)
                        embedding = keep_whole = None  # the float table: freed now
                    elif quantizer is not None and complete_linear(module) and module is not keep_whole:
                        parent, attr = parents[id(module)]
                        setattr(parent, attr, quantizer(module))
                        module.weight = None  # the source: freed now, not when the load ends
                    del module
                    tensor = None
                    give_back_freed()
    del parents, places, keep_whole, embedding  # the modules swapped out, and the float tables they held
    init_buffers(model)
    if meta := [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]:
        raise NotStreamable(f"{len(meta)} tensors were not in the files ({meta[0]}, ...)")
    with contextlib.suppress(OSError):  # as from_pretrained: generation_config.json where there is one
        model.generation_config = GenerationConfig.from_pretrained(directory)
    if quantizer is not None:
        finish_quantizing(model, quantizer)
    return model


def _shards(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return [directory / f for f in dict.fromkeys(json.loads(index.read_text())["weight_map"].values())]
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    raise NotStreamable(f"no model.safetensors (or its index) in {directory}")


def _header(path: Path) -> tuple[dict[str, dict], int]:
    """A safetensors file's entries by name ({dtype, shape, data_offsets}) and where its data starts: an 8-byte
    little-endian length, then that many bytes of JSON."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        entries = json.loads(file.read(length))
    entries.pop("__metadata__", None)
    if unknown := {e["dtype"] for e in entries.values()} - SAFETENSORS_DTYPES.keys():
        raise NotStreamable(f"{path.name} holds dtypes read here by none: {', '.join(sorted(unknown))}")
    return entries, 8 + length


def _read(file, start: int, entry: dict) -> torch.Tensor:
    """One tensor, read into memory of its own (no mapping of the file outlives the call)."""
    begin, end = entry["data_offsets"]
    raw = torch.empty(end - begin, dtype=torch.uint8)
    view, done = memoryview(raw.numpy()), 0
    file.seek(start + begin)
    while done < len(view):
        got = file.readinto(view[done:done + READ_CHUNK])
        if not got:
            raise NotStreamable(f"{file.name} ends inside a tensor")
        done += got
    return raw.view(SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])


