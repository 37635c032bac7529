"""Filling a model built on the meta device, tensor by tensor: what the safetensors and GGUF streamers share
(app/models/streamed_load.py, app/models/gguf_load.py). Where each checkpoint name goes, whether the names match the
model, putting a read tensor in place of its meta tensor (tied names included), the buffers computed rather than
read, and giving freed heap back to the OS between tensors."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import torch
from torch import nn

from app.heap import release_free_heap

READ_CHUNK = 64 * 2**20  # bytes per read call


class NotStreamable(Exception):
    """Why this checkpoint loads through from_pretrained instead."""


def places_of(model: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
    """Each persistent parameter's or buffer's name -> every (module, attribute) that holds the same tensor (a tied
    lm_head's weight is the embedding's, under both names)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    places: dict[str, list[tuple[nn.Module, str]]] = {}
    for prefix, module in model.named_modules():
        owned = [*module._parameters.items(),
                 *((n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set)]
        for attr, tensor in owned:
            if tensor is not None:
                places[f"{prefix}.{attr}" if prefix else attr] = holders.setdefault(id(tensor), [])
                holders[id(tensor)].append((module, attr))
    return places


def match_names(model: nn.Module, places: dict[str, list], headers: dict[Path, tuple[dict, int]]) -> set[str]:
    """The checkpoint's names to read: each must be a tensor of the model of the same shape, and each of the model's
    tensors (one name of a tied group) must be in the files."""
    ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    ignored.append(re.compile(r"rotary_emb\.inv_freq"))  # old checkpoints kept it; it is computed now
    names = {n: e for entries, _ in headers.values() for n, e in entries.items()}
    if unknown := [n for n in names if n not in places and not any(p.search(n) for p in ignored)]:
        raise NotStreamable(f"{len(unknown)} names in the files are not the model's ({unknown[0]}, ...): "
                            "transformers renames or converts them")
    wanted = {n for n in names if n in places}
    for name in wanted:
        module, attr = places[name][0]
        if list(getattr(module, attr).shape) != list(names[name]["shape"]):
            raise NotStreamable(f"{name} has shape {names[name]['shape']} in the files, "
                                f"{list(getattr(module, attr).shape)} in the model")
    groups: dict[int, list[str]] = {}
    for name, holders in places.items():
        groups.setdefault(id(holders), []).append(name)
    for group in groups.values():
        if (found := len(wanted.intersection(group))) != 1:
            raise NotStreamable(f"{group[0]}: {'missing from' if not found else 'in'} the files"
                                f"{' under each of its tied names' if found else ''}")
    return wanted


def put(holders: list[tuple[nn.Module, str]], tensor: torch.Tensor) -> nn.Module:
    """`tensor` in place of the meta tensor at every holder; returns the first holder's module. `holders` is left
    empty: a tied tensor's other names (still in `places_of`'s map) then keep no module, nor the tensor, alive."""
    first, attr = holders[0]
    if attr in first._parameters:  # tied holders share the one Parameter
        tensor = nn.Parameter(tensor, requires_grad=first._parameters[attr].requires_grad)
    for module, attr in holders:
        (module._parameters if attr in module._parameters else module._buffers)[attr] = tensor
    holders.clear()
    return first


TRIM_EVERY = 8  # tensors: about a layer's linears (7 in Qwen2's), so that about one layer's temporaries are held


_TRIMS = itertools.count(1)


def give_back_freed() -> None:
    """glibc keeps freed blocks under 32 MiB (a linear's temporaries while it is quantized) in its heap, between
    the blocks kept (the quantized weights), and the process's resident memory with them: give them back, once every
    TRIM_EVERY calls. Each trim walks the whole heap: after every tensor it cost 1.4 s of a 6 s load of the 0.5B
    shape with QUANT=int8 on a Zen 4 (one run each, on a shared machine), for 30 MiB less peak."""
    if next(_TRIMS) % TRIM_EVERY == 0:
        release_free_heap()


def complete_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear and not any(p.is_meta for p in module._parameters.values() if p is not None)


def init_buffers(model: nn.Module) -> None:
    """The non-persistent buffers (rotary frequencies), computed as from_pretrained does: on the CPU, by the model's
    own `_init_weights` for the module that holds them."""
    for module in model.modules():
        names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
        if names and any(module._buffers[n].is_meta for n in names):
            for name in names:
                module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
            with torch.no_grad():
                model._init_weights(module)
