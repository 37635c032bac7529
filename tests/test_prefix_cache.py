"""The prefix cache on its own: block keys, the hit cap, copies, byte-bounded LRU (not FIFO) and budget accounting."""

from __future__ import annotations

import torch
from transformers import DynamicCache, MistralConfig, Qwen2Config

from app.core.prefix_cache import PrefixCache, supports_prefix_cache

LAYERS, HEADS, DIM = 2, 1, 2
BLOCK = 4
BLOCK_BYTES = LAYERS * 2 * HEADS * BLOCK * DIM * 4  # fp32


def cache_for(token_ids: list[int]) -> DynamicCache:
    """A cache whose keys encode (layer, token id) and values their negatives, so copies can be checked exactly."""
    ids = torch.tensor(token_ids, dtype=torch.float32)
    data = []
    for layer in range(LAYERS):
        k = (ids + 1000 * layer)[None, None, :, None].expand(1, HEADS, len(token_ids), DIM).clone()
        data.append((k, -k))
    return DynamicCache(ddp_cache_data=data)


def hit_tokens(cache: PrefixCache, ids: list[int]) -> int:
    return len(cache.match(ids)) * cache.block_size


def test_a_hit_is_a_copy_of_the_cached_prefix():
    cache = PrefixCache(max_bytes=1 << 20, block_size=BLOCK)
    first = list(range(10, 21))  # 11 tokens: two full blocks
    assert cache.insert(first, cache_for(first)) == 2
    second = first[:8] + [99, 98, 97]
    blocks = cache.match(second)
    assert len(blocks) == 2
    loaded = cache.load(blocks, config=None)
    expected = cache_for(first[:8])
    for got, want in zip(loaded.layers, expected.layers):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    # the request owns its copy: writing into it leaves the cached block untouched
    loaded.layers[0].keys.fill_(0)
    again = cache.load(cache.match(second), config=None)
    assert torch.equal(again.layers[0].keys, expected.layers[0].keys)


def test_the_last_prompt_token_is_always_recomputed():
    cache = PrefixCache(max_bytes=1 << 20, block_size=BLOCK)
    ids = list(range(8))
    cache.insert(ids, cache_for(ids))
    assert hit_tokens(cache, ids) == 4  # 8 tokens cached, but the 8th must be fed to get its logits
    assert hit_tokens(cache, ids + [50]) == 8
    assert hit_tokens(cache, ids[:4]) == 0


def test_blocks_match_only_after_the_same_prefix():
    cache = PrefixCache(max_bytes=1 << 20, block_size=BLOCK)
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    cache.insert(ids, cache_for(ids))
    assert hit_tokens(cache, [9, 9, 9, 9, 5, 6, 7, 8, 0]) == 0  # block 2's tokens, after another first block
    assert hit_tokens(cache, [1, 2, 3, 4, 5, 6, 7, 0, 0]) == 4  # diverges inside block 2
    assert cache.insert(ids + [9, 10, 11, 12], cache_for(ids + [9, 10, 11, 12])) == 1  # only the new block


def test_lru_keeps_the_shared_system_prompt_fifo_would_not():
    system = list(range(100, 108))  # two blocks every request starts with
    cache = PrefixCache(max_bytes=5 * BLOCK_BYTES, block_size=BLOCK)  # system + 3 one-off tails fit
    for user in range(20):
        ids = system + [1000 + 4 * user + i for i in range(4)] + [7]
        hit = hit_tokens(cache, ids)
        assert hit == (0 if user == 0 else 8), f"request {user}: the system prompt was evicted"
        cache.insert(ids, cache_for(ids))
        assert cache.bytes <= 5 * BLOCK_BYTES
    assert cache.evictions == 20 - 3  # the one-off tails went, oldest first
    assert len(cache) == 5


def test_only_leaves_are_evicted():
    cache = PrefixCache(max_bytes=3 * BLOCK_BYTES, block_size=BLOCK)
    a = list(range(12))
    cache.insert(a, cache_for(a))  # a chain of three blocks
    b = list(range(100, 104))
    cache.insert(b, cache_for(b))  # needs room: the chain's leaf goes, not its root
    assert hit_tokens(cache, a + [0]) == 8
    assert hit_tokens(cache, b + [0]) == 4


class FakeBudget:
    def __init__(self, free: int):
        self.free = free

    def reserve(self, n_bytes: int) -> bool:
        if n_bytes > self.free:
            return False
        self.free -= n_bytes
        return True

    def release(self, n_bytes: int) -> None:
        self.free += n_bytes


def test_bytes_come_out_of_the_kv_budget_and_go_back():
    budget = FakeBudget(free=3 * BLOCK_BYTES)
    cache = PrefixCache(max_bytes=100 * BLOCK_BYTES, block_size=BLOCK, budget=budget)
    ids = list(range(16))
    assert cache.insert(ids, cache_for(ids)) == 3  # the budget, not max_bytes, stops the fourth block
    assert budget.free == 0 and cache.bytes == 3 * BLOCK_BYTES
    other = list(range(50, 54))
    assert cache.insert(other, cache_for(other)) == 1  # makes room by evicting its own least recent block
    assert budget.free == 0
    assert cache.evict(BLOCK_BYTES) == BLOCK_BYTES  # the engine takes memory back for a request
    assert budget.free == BLOCK_BYTES
    cache.clear()
    assert budget.free == 3 * BLOCK_BYTES and cache.bytes == 0 and len(cache) == 0


def test_zero_bytes_turns_it_off():
    cache = PrefixCache(max_bytes=0, block_size=BLOCK)
    ids = list(range(9))
    assert cache.insert(ids, cache_for(ids)) == 0
    assert cache.match(ids) == []


def test_sliding_window_models_are_not_cached():
    full = Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    sliding = MistralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            sliding_window=8)
    assert supports_prefix_cache(full)
    assert not supports_prefix_cache(sliding)
    # and a cache that dropped tokens to its window is never stored, whatever the config said
    cache = PrefixCache(max_bytes=1 << 20, block_size=BLOCK)
    kv = DynamicCache(config=sliding)
    k = torch.zeros(1, 2, 12, 16)
    for layer in range(2):
        kv.update(k, k, layer)
    assert kv.get_seq_length() == 12 and kv.layers[0].keys.shape[-2] < 12
    assert cache.insert(list(range(12)), kv) == 0
