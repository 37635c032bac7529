"""Automatic prefix caching: the keys and values of earlier prompts, kept so a later prompt that starts the same way
skips prefilling that part.

    prompt ids   [ block 0 | block 1 | block 2 | ... | tail ]      fixed-size blocks of `block_size` tokens
    block key    (parent block's id, the block's own tokens)      a hash chain: a block only matches after the
                                                                  same blocks before it, as in vLLM
    first block  (the request's cache salt, its tokens)           so entries are shared only under one salt
    a hit        the longest run of cached blocks from the start, capped so at least the last prompt token is
                 recomputed (its logits choose the first new token)

Each block holds its KV for every layer in two immutable tensors, keys `[layers, kv_heads, block, key_dim]` and values
`[layers, kv_heads, block, value_dim]` (two, since the sizes may differ: MLA caches a latent and a rotary key).
A hit is copied into the new request's own KVStore (`load`), so requests never share or mutate cached tensors
and a block can be evicted at any time. Keys are exact (Python compares the token tuples on a dict hit), so two
different prompts never share KV because of a hash collision.

A request's cache salt (vLLM's `cache_salt`; the serving layer also salts by API key) is the parent of its first
block, as vLLM mixes the salt into the first block's hash: a prompt is reused only by requests under the same salt,
so one tenant can never learn from `cached_tokens` (or from a faster first token) what another tenant's prompts
held. No salt (None) is one shared namespace of its own.

Eviction is least-recently-used over blocks, bounded in bytes. A hit touches its blocks from the last to the first,
so a parent is always more recent than its children; the least recent block is then always a leaf, and evicting it
never strands a child. A system prompt shared by many requests is touched by each of them, so it stays while
one-off tails go first (a FIFO would evict it first: see tests/fast/test_prefix_cache.py).

Exactness: the cached KV is bit-for-bit what the request would have computed itself, but the rest of the prompt is
then prefilled as a chunk that attends to it rather than in one piece with it. In fp32 that gave the same greedy
tokens in our tests (tiny model, Qwen2.5-0.5B; tests/fast/test_prefix_cache.py); in bf16 the logits may differ by
rounding, as with any change of chunking. With BATCH_INVARIANT on, exactly the same: a prompt's attention runs in
16-token pieces at fixed positions (app/core/runner/pieces.py) however it is chunked, a hit ends on a piece, and
only prompt blocks are inserted (a generated token's keys come from a decode row, not from a piece).

Models with sliding-window layers are not cached: their DynamicCache keeps only the last window of keys, so the full
prefix is not there to store.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence

import torch
from transformers import DynamicCache

from app.core.runner.kv_store import KVStore, kv_cat, kv_nbytes, kv_stack

DEFAULT_BLOCK_SIZE = 16  # vLLM's default; a hit loses at most block_size - 1 tokens to rounding


class KVBudget(Protocol):
    """Where the cache's bytes come from: the engine's KV budget (app/core/engine/kv_budget.py). Each block is its own
    owner there, so evicting one block gives back exactly its bytes."""

    def reserve(self, owner: Hashable, nbytes: int) -> bool: ...

    def release(self, owner: Hashable) -> int: ...


@dataclass(eq=False)
class Block:
    id: int
    key: tuple  # (parent id, token ids of this block)
    parent: Block | None
    keys: torch.Tensor  # [layers, kv_heads, block_size, key_dim]
    values: torch.Tensor  # [layers, kv_heads, block_size, value_dim]
    children: int = 0

    @property
    def nbytes(self) -> int:
        return kv_nbytes(self.keys) + kv_nbytes(self.values)


def keeps_all_keys(config) -> bool:
    """Whether every layer of this model's DynamicCache keeps all past keys (no sliding window). Only then can a
    prefix be stored and restored, and drafts be cropped after any number of tokens (app/core/speculative.py)."""
    return not any(getattr(layer, "is_sliding", False) for layer in DynamicCache(config=config).layers)


def root(salt: str | None) -> int | tuple[str, str]:
    """The parent key of a first block: 0 without a salt, the salt itself otherwise (never equal to a block id)."""
    return 0 if salt is None else ("salt", salt)


class PrefixCache:
    def __init__(self, max_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE, budget: KVBudget | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.max_bytes = max_bytes
        self.block_size = block_size
        self.budget = budget
        self.bytes = 0
        self._blocks: dict[tuple, Block] = {}
        self._lru: OrderedDict[int, Block] = OrderedDict()  # least recent first
        self._next_id = 1  # 0 is the root: the parent of every first block
        self.evictions = 0
        self._inserting = False  # while set, `evict` (the budget's reclaimer) leaves blocks alone: see _make_room

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, prompt_ids: Sequence[int], salt: str | None = None) -> list[Block]:
        """The cached blocks that start `prompt_ids` under `salt`, at most `len(prompt_ids) - 1` tokens' worth;
        marks them used."""
        b = self.block_size
        blocks: list[Block] = []
        parent_id = root(salt)
        for start in range(0, len(prompt_ids) - 1 - b + 1, b):  # full blocks that leave the last token out
            block = self._blocks.get((parent_id, tuple(prompt_ids[start : start + b])))
            if block is None:
                break
            blocks.append(block)
            parent_id = block.id
        self._touch(blocks)
        return blocks

    def load(self, blocks: list[Block], config, limit: int | None = None) -> KVStore:
        """A new KVStore (of at most `limit` tokens) holding a copy of `blocks`' keys and values: the request owns
        it, and writes its next tokens after them in place."""
        keys = kv_cat([block.keys for block in blocks], dim=2)  # [layers, kv_heads, n_tokens, key_dim]
        values = kv_cat([block.values for block in blocks], dim=2)  # [layers, kv_heads, n_tokens, value_dim]
        return KVStore.holding([k[None] for k in keys], [v[None] for v in values], config, limit)

    def insert(self, token_ids: Sequence[int], cache: DynamicCache, salt: str | None = None) -> int:
        """Store the full blocks of `token_ids` whose KV `cache` holds and that are not cached yet, under `salt`;
        returns how many blocks were added. `cache` must hold exactly `token_ids[:cache.get_seq_length()]`."""
        n_tokens = min(len(token_ids), cache.get_seq_length())
        layers = cache.layers
        if self.max_bytes <= 0 or any(layer.keys is None or layer.keys.shape[-2] != n_tokens for layer in layers):
            return 0  # off, or a layer does not hold every past token (sliding window): nothing sound to store
        b, added, path = self.block_size, 0, []
        parent: Block | None = None
        for start in range(0, n_tokens - b + 1, b):
            key = (parent.id if parent else root(salt), tuple(token_ids[start : start + b]))
            block = self._blocks.get(key)
            if block is None:
                keys = kv_stack([layer.keys[0, :, start : start + b] for layer in layers])  # int8: codes, scales
                values = kv_stack([layer.values[0, :, start : start + b] for layer in layers])
                if not self._make_room(kv_nbytes(keys) + kv_nbytes(values), keep=path):
                    break
                block = Block(self._next_id, key, parent, keys, values)
                self._next_id += 1
                self._add(block)
                added += 1
            path.append(block)
            parent = block
        self._touch(path)
        return added

    def evict(self, n_bytes: int) -> int:
        """Free at least `n_bytes` (or everything), least recently used first; returns the bytes freed. The KV
        budget calls this (as a reclaimer) when a request needs memory the cache is holding."""
        freed = 0
        while freed < n_bytes and self._lru and not self._inserting:
            freed += self._evict_one()
        return freed

    def reclaimable(self) -> int:
        """Bytes `evict` could free now (none while a block is being added)."""
        return 0 if self._inserting else self.bytes

    def clear(self) -> None:
        self.evict(self.bytes)

    # ---- bookkeeping ----

    def _touch(self, path: list[Block]) -> None:
        for block in reversed(path):  # leaf first, root last: a parent is always more recent than its children
            self._lru.move_to_end(block.id)

    def _make_room(self, n_bytes: int, keep: list[Block]) -> bool:
        """Evict least-recent blocks until `n_bytes` more fit under max_bytes and in the budget; never a block of
        `keep` (the path being extended). False when it cannot fit."""
        if n_bytes > self.max_bytes:
            return False
        self._touch(keep)  # the path being extended must outlive anything evicted for it
        while self.bytes + n_bytes > self.max_bytes:
            if not self._lru or next(iter(self._lru.values())) in keep:
                return False
            self._evict_one()
        while self.budget is not None and not self._reserve(n_bytes):
            if not self._lru or next(iter(self._lru.values())) in keep:
                return False
            self._evict_one()
        return True

    def _reserve(self, n_bytes: int) -> bool:
        # The budget may call our own `evict` to make room; it must not pick blocks of the path being extended,
        # so that is done here instead, with `keep` in view.
        self._inserting = True
        try:
            return self.budget.reserve(("prefix-cache", self._next_id), n_bytes)
        finally:
            self._inserting = False

    def _add(self, block: Block) -> None:
        self._blocks[block.key] = block
        self._lru[block.id] = block
        self.bytes += block.nbytes
        if block.parent is not None:
            block.parent.children += 1

    def _evict_one(self) -> int:
        _, block = self._lru.popitem(last=False)
        assert block.children == 0, "LRU order keeps parents more recent than their children"
        del self._blocks[block.key]
        if block.parent is not None:
            block.parent.children -= 1
        self.bytes -= block.nbytes
        self.evictions += 1
        if self.budget is not None:
            self.budget.release(("prefix-cache", block.id))
        return block.nbytes
