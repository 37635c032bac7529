"""One forward pass for many requests' decode steps, while each request keeps owning its own DynamicCache.

Every request's cache stays a plain `DynamicCache` (so a request can be cancelled, finished or prefilled alone).
For a batched decode step we hand the model a `BatchedCacheView`: when a layer stores its new keys and values,
the view appends row i to request i's own cache, then returns all rows' keys and values left-padded to the
longest, together with a mask that hides the padding. The padded copy costs about one extra read of the KV
cache per step, which at these context lengths is small next to reading the weights; in exchange there is no
shared block allocator to manage, and the single-request path stays the article's loop.

Padding sits on the left so every row's new token is the last position; RoPE positions come from each
request's own length (position_ids), so padding never shifts them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers import DynamicCache


def can_batch(config: Any) -> bool:
    """The padding mask below is a full-attention mask; sliding-window layers would need their own."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return all(kind == "full_attention" for kind in layer_types)


class BatchedCacheView:
    """Quacks like a transformers Cache for one decode step over several requests' caches."""

    is_compileable = False

    def __init__(self, caches: Sequence[DynamicCache], dtype: torch.dtype, device: torch.device):
        self.caches = list(caches)
        lengths = [cache.get_seq_length() + 1 for cache in caches]  # after this step's token is stored
        self.lengths = lengths
        self.width = max(lengths)
        # additive mask [B, 1, 1, width]: 0 where a row has a real key, the dtype's minimum over its left padding
        pad = torch.arange(self.width, device=device)[None, :] < (self.width - torch.tensor(lengths, device=device))[:, None]
        self.attention_mask = torch.zeros(len(caches), 1, 1, self.width, dtype=dtype, device=device).masked_fill(
            pad[:, None, None, :], torch.finfo(dtype).min)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states, value_states: [B, kv_heads, 1, head_dim] -> padded [B, kv_heads, width, head_dim]."""
        batch, heads, _, dim = key_states.shape
        keys = key_states.new_zeros(batch, heads, self.width, dim)
        values = value_states.new_zeros(batch, heads, self.width, dim)
        for i, cache in enumerate(self.caches):
            k, v = cache.update(key_states[i : i + 1], value_states[i : i + 1], layer_idx)
            keys[i, :, self.width - k.shape[-2] :] = k[0]
            values[i, :, self.width - v.shape[-2] :] = v[0]
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width - 1
