"""One KV cache allocated at start, in blocks; each request's cache is a handle into it (its block ids, its length).

On the eager path each request owns a KVStore (app/core/runner/kv_store.py) whose views change size every token:
nothing a compiler or a CUDA graph can replay. Here the memory is one tensor per layer for keys and one for
values, `[num_blocks + 1, kv_heads, block_size, head_dim]`, allocated once; the last block is the pad block, where
the padding rows of a batch-size bucket write and read (app/core/runner/static_step.py). A request still owns its cache:
`PoolHandle` holds its block ids and length, takes blocks as it grows, writes its new keys in place (no copy of
what is already there) and gives its blocks back when it is released or garbage-collected.

`PoolHandle` quacks like a DynamicCache where the engine uses one (`update`, `get_seq_length`, and `layers` with
`get_seq_length` / `crop` for app/core/engine/faults.py's roll-back), so a pooled request can still share an eager packed
pass with prefill chunks (app/core/runner/packed.py) or speculation's drafts (`crop` drops rejected ones). The prefix
cache meets the pool by copying: a hit loads a DynamicCache that is copied into the pool when its prefill ends, and
a finished request's keys are gathered back out for it (`as_dynamic_cache`). Sharing its blocks in place, as vLLM
does, is not done yet.

`pooled_attention` is registered as an attention implementation: for a pooled decode step it reads every row's
keys through its block table; for anything else it is `packed_attention` itself. An MLA model's pool holds its
latents (`kv_shape`); the step hands the model every row's latents to expand, and attention then gets tensors.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from app.core.runner.kv_store import KVStore
from app.core.runner.packed import grouped_decode_attention, latent_kv, packed_attention

POOLED = "simple_serve_pooled"
POOLED_MASK = "simple_serve_pooled_mask"  # the keyword under which an MLA model's attention gets the step's mask


class PoolExhausted(RuntimeError):
    """No free blocks left: the caller keeps today's DynamicCache path for this request."""


def kv_shape(config) -> tuple[int, int, int, int]:
    """(layers, kv_heads, key_dim, value_dim) of what a decoder config's cache holds per token: for MLA one latent
    and one rotary key (app/core/runner/packed.py's `latent_kv`), not the keys and values it expands them into."""
    text = config.get_text_config(decoder=True)
    if (latent := latent_kv(config)) is not None:
        return text.num_hidden_layers, 1, *latent
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, text.num_key_value_heads, head_dim, head_dim


class KVPool:
    """Per layer: keys `[num_blocks + 1, kv_heads, block_size, key_dim]` and values likewise (`value_dim`); block
    `num_blocks` pads."""

    def __init__(self, config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs at least one block of one token, got {num_blocks} x {block_size}")
        layers, kv_heads, key_dim, value_dim = kv_shape(config)
        blocks = (num_blocks + 1, kv_heads, block_size)
        # zeros, not empty: a masked key still meets its value in a matmul (0 x NaN would be NaN)
        self.keys = [torch.zeros(*blocks, key_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(*blocks, value_dim, dtype=dtype, device=device) for _ in range(layers)]
        if torch.device(device).type == "cuda":  # a captured graph reads them at fixed addresses
            for tensor in self.keys + self.values:
                torch._dynamo.mark_static_address(tensor)
        self.num_blocks, self.block_size, self.pad_block = num_blocks, block_size, num_blocks
        self.device = torch.device(device)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids go first
        self._lock = threading.Lock()  # a handle may be collected on another thread

    @staticmethod
    def bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
        layers, kv_heads, key_dim, value_dim = kv_shape(config)
        return layers * kv_heads * block_size * (key_dim + value_dim) * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        """What the pool holds, its pad block included."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        with self._lock:
            if n > len(self._free):
                raise PoolExhausted(f"the KV pool has {len(self._free)} free blocks, {n} wanted")
            return [self._free.pop() for _ in range(n)]

    def release(self, block_ids: list[int]) -> None:
        with self._lock:
            self._free.extend(reversed(block_ids))
            block_ids.clear()

    def new_handle(self) -> PoolHandle:
        return PoolHandle(self)

    def adopt(self, cache) -> PoolHandle:
        """A handle holding a copy of a DynamicCache's keys and values (done once, when a prefill ends)."""
        handle = PoolHandle(self)
        for layer_idx, layer in enumerate(cache.layers):
            handle.update(layer.keys, layer.values, layer_idx)
        return handle


class _PoolLayer:
    """One layer's length, as app/core/engine/faults.py reads and cuts a DynamicCache layer."""

    is_sliding = False

    def __init__(self):
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """As DynamicCache's crop: keep the first max_length tokens (negative: drop that many from the end)."""
        self.length = max(0, self.length + max_length if max_length < 0 else min(self.length, max_length))


class PoolHandle:
    """A request's own KV cache inside the pool: its block ids (in order) and each layer's length."""

    is_compileable = False

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.block_ids: list[int] = []
        self.block_table = torch.empty(0, dtype=torch.long, device=pool.device)  # block_ids on the device
        self.layers = [_PoolLayer() for _ in pool.keys]
        # The blocks go back when the request's Sequence goes (the engine drops it when the request ends).
        self._finalizer = weakref.finalize(self, pool.release, self.block_ids)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length

    get_query_offset = get_seq_length  # where transformers places a pass's first query: after what is cached

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """(keys the pass's mask spans, their offset), as a DynamicCache's full-attention layer answers."""
        return self.layers[layer_idx].length + query_length, 0

    def release(self) -> None:
        self._finalizer()

    def crop(self, max_length: int) -> None:
        """As DynamicCache.crop, every layer: speculation drops a rejected draft's keys this way. The blocks stay
        held: the next tokens are written over them."""
        for layer in self.layers:
            layer.crop(max_length)

    def as_dynamic_cache(self, config) -> KVStore:
        """A KVStore (app/core/runner/kv_store.py) holding a copy of this request's keys and values, one gather per
        layer: what the prefix cache stores from at the request's end, and a row's own cache when it leaves the
        pool."""
        lengths = [layer.length for layer in self.layers]
        return KVStore.holding([self.read(keys, n) for keys, n in zip(self.pool.keys, lengths)],
                               [self.read(values, n) for values, n in zip(self.pool.values, lengths)], config)

    def reserve(self, length: int) -> None:
        """Hold enough blocks for `length` tokens (raises PoolExhausted, taking none, if the pool cannot)."""
        wanted = -(-length // self.pool.block_size) - len(self.block_ids)
        if wanted > 0:
            self.block_ids.extend(self.pool.allocate(wanted))
            self.block_table = torch.tensor(self.block_ids, dtype=torch.long, device=self.pool.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states, value_states: [1, kv_heads, n, head_dim] -> this layer's keys and values so far,
        [1, kv_heads, length, head_dim] each (the eager packed pass's view; the compiled step reads the pool)."""
        layer, n = self.layers[layer_idx], key_states.shape[-2]
        start, end = layer.length, layer.length + n
        self.reserve(end)
        positions = torch.arange(start, end, device=self.pool.device)
        blocks, offsets = self.block_table[positions // self.pool.block_size], positions % self.pool.block_size
        self.pool.keys[layer_idx][blocks, :, offsets] = key_states[0].transpose(0, 1)  # [n, kv_heads, head_dim]
        self.pool.values[layer_idx][blocks, :, offsets] = value_states[0].transpose(0, 1)
        layer.length = end
        return self.read(self.pool.keys[layer_idx], end), self.read(self.pool.values[layer_idx], end)

    def read(self, pool_layer: torch.Tensor, length: int) -> torch.Tensor:
        """[1, kv_heads, length, dim]: this request's blocks of one pool layer, in order."""
        blocks = pool_layer[self.block_table]  # [n_blocks, kv_heads, block_size, dim]
        _, kv_heads, _, head_dim = blocks.shape
        return blocks.transpose(0, 1).reshape(kv_heads, -1, head_dim)[None, :, :length]


@dataclass
class PooledKV:
    """One layer's keys (or values) for a pooled decode step: the whole pool layer, and how the step's rows read
    it. Only app/core/runner/static_step.py makes these; `pooled_attention` knows them by type."""

    pool: torch.Tensor  # [num_blocks + 1, kv_heads, block_size, head_dim]
    table: torch.Tensor  # [B, W] block ids per row, padded with the pad block
    mask: torch.Tensor  # [B, 1, 1, W * block_size] fp32, 0 where a row sees a key, a large negative elsewhere

    def gather(self) -> torch.Tensor:
        """[B, kv_heads, W * block_size, head_dim] fp32: every row's blocks in order."""
        return self.rows().float()

    def rows(self) -> torch.Tensor:
        """[B, kv_heads, W * block_size, head_dim] in the pool's dtype: every row's blocks in order."""
        blocks = self.pool[self.table]  # [B, W, kv_heads, block_size, head_dim]
        batch, width, kv_heads, block_size, head_dim = blocks.shape
        return blocks.transpose(1, 2).reshape(batch, kv_heads, width * block_size, head_dim)


def pooled_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """query: [B, heads, 1, head_dim], one decode token per row, over its keys in the pool -> [B, 1, heads, d].
    Two fp32 matmuls, as the packed pass does for decode rows on a CPU in half precision (and here in fp32 too:
    one formula for every dtype, which the compiler fuses).

    MLA: the model expanded every row's latents (`PooledKV.rows`) into keys and values itself, so they arrive as
    tensors, [B, heads, W * block_size, d_k or d_v], with the step's mask under POOLED_MASK."""
    if (mask := kwargs.pop(POOLED_MASK, None)) is not None:
        out = grouped_decode_attention(query, key.float(), value.float(), mask, scaling or query.shape[-1] ** -0.5)
        return out.to(query.dtype)[:, None], None
    if not isinstance(key, PooledKV):
        return packed_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                **kwargs)
    out = grouped_decode_attention(query, key.gather(), value.gather(), key.mask, scaling or query.shape[-1] ** -0.5)
    return out.to(query.dtype)[:, None], None  # [B, 1, heads, head_dim]


AttentionInterface.register(POOLED, pooled_attention)
AttentionMaskInterface.register(POOLED, sdpa_mask)  # solo calls get exactly the masks SDPA would get
