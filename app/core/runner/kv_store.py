"""A request's own KV cache whose storage grows by doubling, so a decode step appends in place.

transformers' DynamicLayer grows by `torch.cat`: every token, every layer, a new tensor and a copy of all its keys
and values. `GrowingLayer` keeps them in storage `[1, kv_heads, capacity, d]`, writes new tokens after the filled
part and hands out views of it, `[1, kv_heads, length, d]`: every reader of `layer.keys` (attention, the prefix
cache, the KV pool's `adopt`, app/core/engine/faults.py) sees the usual shape. Full storage doubles, never past
`limit` (prompt + max_tokens, what the KV budget reserved): O(log n) copies for n tokens. `crop` (rejected drafts, a
rolled-back pass) moves the length back and the next tokens overwrite the dropped ones; no view outlives its pass.
`KVStore` is a DynamicCache with these for its full-attention layers (a sliding layer never outgrows its window).

An 8-bit cache (KV_CACHE_DTYPE=int8, to come) belongs in this store, not a second one: the layer owns its storage's
dtype. An int8 layer keeps int8 `[1, kv_heads, capacity, d]` storage and beside it scales `[1, kv_heads, capacity,
d // group]` (one per token, head and group of 32 channels, as llama.cpp's q8_0), grown together by `_grow`;
`update` quantizes only the new tokens (absmax per group) as it writes them. It hands attention a dequantizing view
(the filled part's data and scales) instead of a slice; decode attention dequantizes where it now casts bf16 into
its fp32 scratch (`PackedCaches.fp32`, app/core/runner/packed.py), the same pass over half the bytes. Prefill chunks
and BATCH_INVARIANT's calls dequantize the slice they attend to, the prefix cache stores data and scales as they
lie, the KV budget's bytes per token read the store's dtype, and `crop` stays a length change.
"""

from __future__ import annotations

from functools import partial

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 256  # tokens of storage a layer starts with (or its first pass, if longer)


class GrowingLayer(DynamicLayer):
    """One full-attention layer: `keys` / `values` are views [1, kv_heads, length, d] of storage that grows by
    doubling. `grows` counts the reallocations (a test bounds it)."""

    def __init__(self, limit: int | None = None):
        super().__init__()
        self.limit = limit  # most tokens this layer will ever hold (None: unbounded)
        self.length = 0
        self.grows = 0
        self._keys: torch.Tensor | None = None  # storage [1, kv_heads, capacity, d_k]
        self._values: torch.Tensor | None = None  # storage [1, kv_heads, capacity, d_v]

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states: [1, kv_heads, n, d] new tokens -> views of every token so far, written in place."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(key_states, value_states, end)
        self._keys[..., start:end, :] = key_states
        self._values[..., start:end, :] = value_states
        self._set_length(end)
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        """New storage of at least `needed` tokens (twice the old, at least MIN_CAPACITY, at most `limit`), holding a
        copy of the filled part."""
        capacity = max(needed, MIN_CAPACITY, 2 * self.capacity)
        if self.limit is not None:
            capacity = max(needed, min(capacity, self.limit))
        with torch.inference_mode(False):  # plain tensors: a write outside inference mode must not fail later
            keys = key_states.new_empty(*key_states.shape[:2], capacity, key_states.shape[-1])
            values = value_states.new_empty(*value_states.shape[:2], capacity, value_states.shape[-1])
        if self.length:
            keys[..., : self.length, :] = self.keys
            values[..., : self.length, :] = self.values
        self._keys, self._values = keys, values
        self.grows += 1

    def _set_length(self, length: int) -> None:
        self.length = length
        if self._keys is not None:
            self.keys, self.values = self._keys[..., :length, :], self._values[..., :length, :]

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """As DynamicLayer's: drop the last `-tokens_to_remove` tokens (a length change; the storage stays)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        self._set_length(max(0, self.length + tokens_to_remove))

    def reset(self) -> None:
        self._keys = self._values = None
        self.length = 0
        super().reset()


class KVStore(DynamicCache):
    """A request's DynamicCache with `GrowingLayer`s for its full-attention layers. `limit`: the most tokens it
    will hold (prompt + max_tokens), so that doubling never reserves past what the KV budget counted."""

    def __init__(self, config, limit: int | None = None):
        super().__init__(config=config)
        self.layers = [GrowingLayer(limit) if type(layer) is DynamicLayer else layer for layer in self.layers]
        if self.layer_class_to_replicate is not None:  # no config: layers made as `update` first meets them
            self.layer_class_to_replicate = partial(GrowingLayer, limit)

    @classmethod
    def holding(cls, keys: list[torch.Tensor], values: list[torch.Tensor], config,
                limit: int | None = None) -> KVStore:
        """A store holding a copy of each layer's keys and values, [1, kv_heads, n, d] each (a prefix cache hit)."""
        store = cls(config, limit)
        for layer_idx, (k, v) in enumerate(zip(keys, values)):
            store.update(k, v, layer_idx)
        return store
