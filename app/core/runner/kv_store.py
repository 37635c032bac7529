"""A request's own KV cache whose storage grows by doubling, so a decode step appends in place; in the model's dtype
or, with KV_CACHE_DTYPE=int8, in 8 bits.

transformers' DynamicLayer grows by `torch.cat`: every token, every layer, a new tensor and a copy of all its keys
and values. `GrowingLayer` keeps them in storage `[1, kv_heads, capacity, d]`, writes new tokens after the filled
part and hands out views of it, `[1, kv_heads, length, d]`: every reader of `layer.keys` (attention, the prefix
cache, the KV pool's `adopt`) sees the usual shape. Full storage doubles, never past `limit` (prompt + max_tokens,
what the KV budget reserved): O(log n) copies for n tokens. `crop` (rejected drafts, a rolled-back pass) moves the
length back and the next tokens overwrite the dropped ones; no view outlives its pass. `KVStore` is a DynamicCache
with these for its full-attention layers (a sliding layer never outgrows its window).

`Int8Layer` is the same store in 8 bits (one store, not a second one: only what a slot holds differs). Each token's
keys and values are kept as int8 codes `[1, kv_heads, capacity, d]` and an fp16 scale per token, head and group of
channels `[.., capacity, d // group]`: absmax / 127, as llama.cpp's q8_0 blocks are. Values take groups of 32 (q8_0's:
34 bytes per 32), keys groups of 8 (10 bytes per 8): in the embedded Qwen2.5-0.5B, served in bf16 over 8,192 tokens
of Python, keys in groups of 32 cost +1.42% perplexity against the bf16 cache and all of it came from the keys
(values in groups of 32 with exact keys: -0.02%); groups of 16 +0.70%, of 8 +0.31%, of 4 +0.01% (a Hadamard rotation
of the keys first bought nothing at 8 or 16). Together 0.58x bf16's bytes. Only the new tokens are quantized, as
they are written. Its `keys` / `values` are `QuantizedKV` views:
decode attention dequantizes each row's keys straight into its fp32 scratch (app/core/runner/packed.py), the same pass
it makes over a bf16 cache, over half the bytes; calls that need dense tensors (a prefill chunk, HF's own attention,
BATCH_INVARIANT's calls) get `update`'s dequantized copy. The prefix cache keeps codes and scales as they lie, so a
hit restores the very values a cold run attends to. Every reader therefore sees the rounded values, prefill included:
a request's answer does not depend on whether its prefix came from the cache or from a chunked prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 256  # tokens of storage a layer starts with (or its first pass, if longer)
KEY_GROUP, VALUE_GROUP = 8, 32  # channels per fp16 scale (module docstring); a head not a multiple of it: one scale


def scales_per_token(dim: int, group: int) -> int:
    """Scales one head of `dim` channels keeps per token in groups of `group` (one where `dim` is no multiple)."""
    return dim // group if dim % group == 0 else 1


@dataclass
class QuantizedKV:
    """Keys or values in 8 bits: `codes` int8 [..., n, d] and `scales` fp16 [..., n, d // group]; value = code *
    scale. Indexing and `shape` act on the leading dims as a tensor's would (never slice the last one)."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def __getitem__(self, index) -> QuantizedKV:
        return QuantizedKV(self.codes[index], self.scales[index])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales))

    def dequantize(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """The values, in `out` (fp32, this shape) if given: the product is taken in fp32, where it is exact."""
        if out is None:
            out = torch.empty(self.codes.shape, dtype=torch.float32, device=self.codes.device)
        groups = self.scales.shape[-1]  # one pass: int8 codes times fp32 scales (a 32nd of the size) into `out`
        torch.mul(self.codes.unflatten(-1, (groups, -1)), self.scales.float()[..., None],
                  out=out.unflatten(-1, (groups, -1)))
        return out if dtype == torch.float32 else out.to(dtype)


def quantize_kv(x: torch.Tensor, group: int = VALUE_GROUP) -> QuantizedKV:
    """[..., d] floats -> int8 codes and an fp16 absmax scale per group of `group` channels."""
    group = x.shape[-1] // scales_per_token(x.shape[-1], group)
    grouped = x.float().unflatten(-1, (-1, group))  # [..., d // group, group]
    scales = (grouped.abs().amax(-1) / 127).clamp_(max=torch.finfo(torch.float16).max).to(torch.float16)
    divisor = scales.float().clamp_(min=torch.finfo(torch.float32).tiny)[..., None]  # an all-zero group: codes 0
    codes = (grouped / divisor).round_().clamp_(-127, 127).to(torch.int8)  # not in place: x.float() may be x
    return QuantizedKV(codes.flatten(-2), scales)


def kv_cat(parts: list, dim: int):
    """torch.cat for tensors or QuantizedKVs (along a dim before the last)."""
    if isinstance(parts[0], QuantizedKV):
        return QuantizedKV(torch.cat([p.codes for p in parts], dim), torch.cat([p.scales for p in parts], dim))
    return torch.cat(parts, dim)


def kv_stack(parts: list):
    """torch.stack for tensors or QuantizedKVs."""
    if isinstance(parts[0], QuantizedKV):
        return QuantizedKV(torch.stack([p.codes for p in parts]), torch.stack([p.scales for p in parts]))
    return torch.stack(parts)


def kv_nbytes(t) -> int:
    return t.nbytes() if isinstance(t, QuantizedKV) else t.numel() * t.element_size()


class GrowingLayer(DynamicLayer):
    """One full-attention layer: `keys` / `values` are views [1, kv_heads, length, d] of storage that grows by
    doubling. `grows` counts the reallocations (a test bounds it)."""

    def __init__(self, limit: int | None = None):
        super().__init__()
        self.limit = limit  # most tokens this layer will ever hold (None: unbounded)
        self.length = 0
        self.grows = 0
        self._storage: list[torch.Tensor] = []  # each [1, kv_heads, capacity, ...]: what `_encode` gives per token

    @property
    def capacity(self) -> int:
        return self._storage[0].shape[-2] if self._storage else 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = (key_states.codes if isinstance(key_states, QuantizedKV) else key_states).device
        self.is_initialized = True

    def _encode(self, key_states: torch.Tensor, value_states: torch.Tensor) -> list[torch.Tensor]:
        """What the storage holds for these tokens, in the order of `_storage`."""
        return [key_states, value_states]

    def _views(self, parts: list[torch.Tensor]) -> tuple:
        return parts[0], parts[1]

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple:
        """key_states, value_states: [1, kv_heads, n, d] new tokens, written in place -> views of every token so
        far, as the layer keeps them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        parts = self._encode(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(parts, end)
        for storage, part in zip(self._storage, parts):
            storage[..., start:end, :] = part
        self._set_length(end)
        return self.keys, self.values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """As DynamicLayer's: the keys and values of every token so far, as tensors."""
        return self.append(key_states, value_states)

    def _grow(self, parts: list[torch.Tensor], needed: int) -> None:
        """New storage of at least `needed` tokens (twice the old, at least MIN_CAPACITY, at most `limit`), holding a
        copy of the filled part."""
        capacity = max(needed, MIN_CAPACITY, 2 * self.capacity)
        if self.limit is not None:
            capacity = max(needed, min(capacity, self.limit))
        with torch.inference_mode(False):  # plain tensors: a write outside inference mode must not fail later
            grown = [part.new_empty(*part.shape[:2], capacity, part.shape[-1]) for part in parts]
        for new, old in zip(grown, self._storage):
            new[..., : self.length, :] = old[..., : self.length, :]
        self._storage = grown
        self.grows += 1

    def _set_length(self, length: int) -> None:
        self.length = length
        if self._storage:
            self.keys, self.values = self._views([s[..., :length, :] for s in self._storage])

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """As DynamicLayer's: drop the last `-tokens_to_remove` tokens (a length change; the storage stays)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        self._set_length(max(0, self.length + tokens_to_remove))

    def reset(self) -> None:
        self._storage, self.length, self.keys, self.values, self.is_initialized = [], 0, None, None, False


class Int8Layer(GrowingLayer):
    """A GrowingLayer in 8 bits (module docstring): `keys` / `values` are QuantizedKV views; `update` hands HF's
    attention dense copies in the model's dtype."""

    def _encode(self, key_states, value_states) -> list[torch.Tensor]:
        if isinstance(key_states, QuantizedKV):  # a prefix cache hit: the codes as they were kept
            k, v = key_states, value_states
        else:
            k, v = quantize_kv(key_states, KEY_GROUP), quantize_kv(value_states, VALUE_GROUP)
        return [k.codes, v.codes, k.scales, v.scales]

    def _views(self, parts: list[torch.Tensor]) -> tuple:
        return QuantizedKV(parts[0], parts[2]), QuantizedKV(parts[1], parts[3])

    def update(self, key_states, value_states, *args, **kwargs):
        self.dtype = key_states.dtype
        keys, values = self.append(key_states, value_states)
        return keys.dequantize(self.dtype), values.dequantize(self.dtype)


class KVStore(DynamicCache):
    """A request's DynamicCache with `GrowingLayer`s (`int8`: `Int8Layer`s) for its full-attention layers.
    `limit`: the most tokens it will hold (prompt + max_tokens), so that doubling never reserves past what the KV
    budget counted."""

    def __init__(self, config, limit: int | None = None, int8: bool = False):
        super().__init__(config=config)
        layer = partial(Int8Layer if int8 else GrowingLayer, limit)
        self.int8 = int8
        self.layers = [layer() if type(old) is DynamicLayer else old for old in self.layers]
        if self.layer_class_to_replicate is not None:  # no config: layers made as `update` first meets them
            self.layer_class_to_replicate = layer

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> tuple:
        """As `update`, but an int8 layer hands back its QuantizedKV views, not dense copies (packed decode rows
        read them where they lie)."""
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if isinstance(layer, GrowingLayer):
            return layer.append(key_states, value_states)
        return self.update(key_states, value_states, layer_idx)

    @classmethod
    def holding(cls, keys: list, values: list, config, limit: int | None = None) -> KVStore:
        """A store holding a copy of each layer's keys and values, [1, kv_heads, n, d] each (a prefix cache hit):
        int8 where they are QuantizedKVs, kept as they are."""
        store = cls(config, limit, int8=isinstance(keys[0], QuantizedKV))
        for layer_idx, (k, v) in enumerate(zip(keys, values)):
            store.append(k, v, layer_idx)
        return store
