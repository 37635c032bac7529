"""The prefix cache on its own: block keys, the hit cap, copies, byte-bounded LRU (not FIFO) and budget accounting."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import DynamicCache, MistralConfig, Qwen2Config

from app.core.engine.prefix_cache import PrefixCache, keeps_all_keys
from app.core.sampling import SamplingParams
from engine_runs import run_engine

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


def kv_budget(capacity: int):
    """The engine's KV budget (app/core/engine/kv_budget.py) when it is there; else the same two calls over a dict."""
    try:
        from app.core.engine.kv_budget import KVBudget
    except ImportError:
        class KVBudget:
            def __init__(self, capacity):
                self.capacity, self.held = capacity, {}

            @property
            def in_use(self):
                return sum(self.held.values())

            def reserve(self, owner, nbytes):
                if self.in_use + nbytes > self.capacity:
                    return False
                self.held[owner] = self.held.get(owner, 0) + nbytes
                return True

            def release(self, owner):
                return self.held.pop(owner, 0)
    return KVBudget(capacity)


def test_bytes_come_out_of_the_kv_budget_and_go_back():
    budget = kv_budget(3 * BLOCK_BYTES)
    cache = PrefixCache(max_bytes=100 * BLOCK_BYTES, block_size=BLOCK, budget=budget)
    ids = list(range(16))
    assert cache.insert(ids, cache_for(ids)) == 3  # the budget, not max_bytes, stops the fourth block
    assert budget.in_use == 3 * BLOCK_BYTES == cache.bytes
    other = list(range(50, 54))
    assert cache.insert(other, cache_for(other)) == 1  # makes room by evicting its own least recent block
    assert budget.in_use == 3 * BLOCK_BYTES
    assert cache.evict(BLOCK_BYTES) == BLOCK_BYTES  # the engine takes memory back for a request
    assert budget.in_use == 2 * BLOCK_BYTES
    cache.clear()
    assert budget.in_use == 0 and cache.bytes == 0 and len(cache) == 0


def test_zero_bytes_turns_it_off():
    cache = PrefixCache(max_bytes=0, block_size=BLOCK)
    ids = list(range(9))
    assert cache.insert(ids, cache_for(ids)) == 0
    assert cache.match(ids) == []


def test_sliding_window_models_are_not_cached():
    full = Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    sliding = MistralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            sliding_window=8)
    assert keeps_all_keys(full)
    assert not keeps_all_keys(sliding)
    # and a cache that dropped tokens to its window is never stored, whatever the config said
    cache = PrefixCache(max_bytes=1 << 20, block_size=BLOCK)
    kv = DynamicCache(config=sliding)
    k = torch.zeros(1, 2, 12, 16)
    for layer in range(2):
        kv.update(k, k, layer)
    assert kv.get_seq_length() == 12 and kv.layers[0].keys.shape[-2] < 12
    assert cache.insert(list(range(12)), kv) == 0


# ---- through the engine: a hit changes no token ----

SYSTEM = ("You are a careful assistant. Answer in short sentences, cite the Seine and Paris when relevant, "
          "and never use emoji.")


def conversation_requests(lm, max_tokens: int):
    greedy = SamplingParams(max_tokens=max_tokens, do_sample=False)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which city is on the Seine?"}]
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "北京是中国的首都吗？"}]
    return [(lm.encode_chat(first), greedy), (lm.encode_chat(other), greedy),
            (lm.encode_chat(other), SamplingParams(max_tokens=max_tokens, seed=5, temperature=0.9))]


def check_hits_change_nothing(lm, max_tokens: int):
    requests = conversation_requests(lm, max_tokens)
    off, _ = run_engine(lm, requests, prefix_cache_bytes=0, speculative="off")
    on, engine = run_engine(lm, requests, prefix_cache_bytes=64 * 2**20, speculative="off")
    assert [s.tokens for s in on] == [s.tokens for s in off]
    shared = next(i for i, (a, b) in enumerate(zip(requests[0][0], requests[1][0])) if a != b)
    block = engine.prefix_cache.block_size
    assert on[0].cached_tokens == 0
    assert on[1].cached_tokens == shared // block * block  # the system prompt's whole blocks
    assert on[2].cached_tokens == (len(requests[2][0]) - 1) // block * block  # all but the last token's block
    assert engine.metrics.prefix_cache_hits._value.get() == on[1].cached_tokens + on[2].cached_tokens


def test_tiny_greedy_tokens_are_the_same_with_prefix_hits(tiny_lm):
    check_hits_change_nothing(tiny_lm, 16)


@pytest.mark.real_model
def test_qwen_greedy_tokens_are_the_same_with_prefix_hits(qwen_fp32):
    check_hits_change_nothing(qwen_fp32, 16)


def test_a_later_turn_reuses_the_previous_answer(tiny_lm):
    """The previous turn's prompt + answer are cached at its end, so the next turn hits past the first prompt."""
    first = tiny_lm.encode_chat([{"role": "user", "content": "Tell me about Paris."}])
    params = SamplingParams(max_tokens=20, do_sample=False, ignore_eos=True)
    (answer,), engine = run_engine(tiny_lm, [(first, params)], prefix_cache_bytes=2**20, speculative="off")
    follow_up = first + answer.tokens + tiny_lm.encode_text("<|im_end|>\n<|im_start|>user\nMore?<|im_end|>\n")
    blocks = engine.prefix_cache.match(follow_up)
    assert len(blocks) * engine.prefix_cache.block_size > len(first)


def test_cached_tokens_in_usage_and_metrics(make_tiny_server):
    body = {"model": "tiny", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
            "temperature": 0, "max_tokens": 4}
    server = make_tiny_server()
    first, second = (httpx.post(server.url + "/v1/chat/completions", json=body).json() for _ in range(2))
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    hit = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < hit < second["usage"]["prompt_tokens"]
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
    metrics = httpx.get(server.url + "/metrics").text
    assert f"simple_serve_prefix_cache_hit_tokens_total {float(hit)}" in metrics
    queried = next(float(line.split()[1]) for line in metrics.splitlines()
                   if line.startswith("simple_serve_prefix_cache_queried_tokens_total"))
    assert queried >= 2 * first["usage"]["prompt_tokens"]  # and the server's warm-up prompt
    # the Responses API reports the same figure for the same conversation (it used to say 0 always)
    responses = {"model": "tiny", "instructions": SYSTEM, "input": "Hi", "temperature": 0, "max_output_tokens": 4}
    usage = httpx.post(server.url + "/v1/responses", json=responses).json()["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] == hit and usage["input_tokens"] == first["usage"][
        "prompt_tokens"]
    off = make_tiny_server(prefix_cache_bytes=0)
    again = [httpx.post(off.url + "/v1/chat/completions", json=body).json() for _ in range(2)]
    assert again[1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_requests_take_memory_back_from_the_prefix_cache(tiny_lm):
    """The cache's bytes come out of the KV budget; a request that needs them gets them (the cache evicts), and
    the budget never holds more than its capacity."""
    per_token = 512  # tiny model: 2 layers x 2 KV heads x 16 dims x (key, value) x 4 bytes
    first = tiny_lm.encode_text("The capital of France is Paris. Paris is a city on the Seine. " * 2)
    second = tiny_lm.encode_text("北京是中国的首都。上海是一个大城市。")
    params = SamplingParams(max_tokens=8, do_sample=False, ignore_eos=True)
    capacity = per_token * (len(first) + 8) + per_token * 16  # one request, and a block to spare
    seen, engine = run_engine(tiny_lm, [(first, params), (second, params), (first, params)],
                              kv_cache_bytes=capacity, prefix_cache_bytes=1 << 20)
    assert engine.kv_layout.bytes_per_token == per_token
    assert [s.finish_reason for s in seen] == ["length"] * 3  # nobody waited forever for the cache's bytes
    assert engine.prefix_cache.evictions > 0
    assert engine.kv_budget.in_use == engine.prefix_cache.bytes <= capacity
