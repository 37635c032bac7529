"""The engine, driven directly (no HTTP): a burst of new requests takes turns at prefill, so the first arrivals
start streaming while later prompts are still being read; long prompts in both modes (packed, one request per
pass); failing passes, out-of-memory retries and a dying engine thread; KV-budget admission."""

from __future__ import annotations

import asyncio

import pytest
import torch

from app.core.engine.engine import Engine, EngineDead, GenerationFailed, default_prefill_tokens_per_step
from app.core.generate import generate
from app.core.engine.kv_budget import KVBudget, KVLayout
from app.core.sampling import SamplingParams
from app.errors import InvalidRequest, ServeError


class RecordingEngine(Engine):
    """Notes which request each token event was emitted for, in the worker's own order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.emitted: list[str] = []

    def _emit(self, handle, event):
        self.emitted.append(handle.request_id)
        super()._emit(handle, event)


async def tokens_before_first(lm, prefill_tokens_per_step: int, prompts: list[list[int]],
                              packed: bool = True) -> list[list[int]]:
    """Submit all prompts at once; for each request, how many tokens every request had been sent when its
    first token was emitted."""
    engine = RecordingEngine(lm, max_active=8, prefill_tokens_per_step=prefill_tokens_per_step,
                             packed_batching=packed)
    engine.start()
    await asyncio.to_thread(engine.loaded.wait)
    params = SamplingParams(max_tokens=12, do_sample=False, ignore_eos=True)
    handles = [engine.submit(ids, params, request_id=str(i)) for i, ids in enumerate(prompts)]

    async def consume(handle) -> int:
        return sum([1 async for _ in handle])

    try:
        assert await asyncio.gather(*(consume(h) for h in handles)) == [12] * len(prompts)
    finally:
        engine.stop()
    ids = [str(i) for i in range(len(prompts))]
    firsts = [engine.emitted.index(i) for i in ids]
    return [[engine.emitted[:first].count(j) for j in ids] for first in firsts]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one-per-pass"])
def test_a_burst_takes_turns_at_prefill(tiny_lm, packed):
    prompts = [tiny_lm.encode_text(f"Request {i}: tell me about Paris, the Seine and its many bridges.")
               for i in range(4)]
    assert all(len(p) > 16 for p in prompts)
    # 16 prompt tokens per step: each prompt needs two or more steps, so the first request is streaming
    # before the last one's prefill is done.
    small = asyncio.run(tokens_before_first(tiny_lm, 16, prompts, packed))
    assert small[-1][0] >= 3, small
    # With room for every prompt in one step, all first tokens come out of that same step.
    big = asyncio.run(tokens_before_first(tiny_lm, 4096, prompts, packed))
    assert all(sum(before) <= len(prompts) - 1 for before in big), big


def test_default_prefill_budget_is_small_on_cpu_and_large_on_gpu():
    assert default_prefill_tokens_per_step(torch.device("cpu")) == 128
    assert default_prefill_tokens_per_step(torch.device("cuda")) == 2048


# ---- helpers for driving an engine from a test ----

def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, do_sample=False, ignore_eos=True, **extra)


def solo_tokens(lm, ids, params) -> list[int]:
    return [e.token_id for e in generate(lm.model, lm.tokenizer, ids, params, lm.eos_ids, lm.max_context)]


async def outcome(handle) -> list[int] | ServeError:
    """The request's token ids, or the error it ended with."""
    tokens = []
    try:
        async for event in handle:
            tokens.append(event.token_id)
    except ServeError as err:
        return err
    return tokens


def run_engine(engine_factory, scenario, timeout: float = 120):
    """Start an engine, run `await scenario(engine)` on a fresh event loop, stop the engine. The timeout turns a
    hang into a failure."""
    async def main():
        engine = engine_factory()
        engine.start()
        await asyncio.to_thread(engine.loaded.wait)
        try:
            return await asyncio.wait_for(scenario(engine), timeout=timeout)
        finally:
            engine.stop()
    return asyncio.run(main())


def long_prompts(lm, count=3):
    return [lm.encode_text(f"Prompt {i}: " + "Paris is a city on the Seine, with many bridges and museums. " * 3)
            for i in range(count)]


# ---- prompts longer than one prefill chunk, in both modes ----

@pytest.mark.full
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one-per-pass"])
def test_prompts_longer_than_a_chunk_in_both_modes(tiny_lm, packed):
    prompts = long_prompts(tiny_lm)
    assert all(len(p) > 3 * 16 for p in prompts)
    params = greedy(10)

    async def scenario(engine):
        assert engine.batch_decode is packed
        return await asyncio.gather(*(outcome(engine.submit(ids, params)) for ids in prompts))

    got = run_engine(lambda: Engine(tiny_lm, prefill_tokens_per_step=16, packed_batching=packed), scenario)
    assert got == [solo_tokens(tiny_lm, ids, params) for ids in prompts]


# ---- a failing forward pass fails only its requests ----

def test_failing_pass_fails_only_its_requests_and_frees_them(tiny_lm, monkeypatch):
    """One request per pass: a kernel error in request A's pass fails A with a clean error; B, in its own
    passes, streams on; the engine serves the next request; A's reservation and cache are gone."""
    import app.core.engine.step as step_module

    real_pass = step_module.run_pass
    poisoned = tiny_lm.encode_text("poisoned prompt")

    def failing_pass(model, work, *args):
        if any(seq.token_ids[0, : seq.prompt_len].tolist() == poisoned for seq, _ in work):
            raise RuntimeError("simulated kernel error")
        return real_pass(model, work, *args)

    monkeypatch.setattr(step_module, "run_pass", failing_pass)
    ok = tiny_lm.encode_text("a healthy prompt")

    async def scenario(engine):
        results = await asyncio.gather(outcome(engine.submit(ok, greedy(12))), outcome(engine.submit(poisoned,
                                                                                                     greedy(12))))
        after = await outcome(engine.submit(ok, greedy(5)))
        return results, after, engine.kv_budget.in_use, engine.in_flight

    (healthy, failed), after, reserved, in_flight = run_engine(lambda: Engine(tiny_lm, packed_batching=False),
                                                               scenario)
    assert healthy == solo_tokens(tiny_lm, ok, greedy(12))
    assert isinstance(failed, GenerationFailed) and "simulated kernel error" in failed.message
    assert after == solo_tokens(tiny_lm, ok, greedy(5))
    assert reserved == 0 and in_flight == 0


@pytest.mark.full
def test_out_of_memory_retries_the_rows_in_smaller_groups(tiny_lm, monkeypatch):
    """An OOM raised half way through a packed pass (after layer 0 and layer 1's attention have written this step's
    keys and values) is undone and the rows retried in halves: every request still gets exactly its solo tokens.
    A row that runs out of memory alone fails, with a clean error, and the others carry on."""
    import app.core.engine.step as step_module

    real_forward, rows_now, ooms = step_module.run_pass, {"n": 0}, []
    poisoned = tiny_lm.encode_text("this one never fits")

    def forward(model, work, *n_out):
        rows_now["n"] = len(work)
        rows_now["poisoned"] = any(seq.token_ids[0, : seq.prompt_len].tolist() == poisoned for seq, _ in work)
        return real_forward(model, work, *n_out)

    def mlp_hook(module, args):
        if rows_now["n"] > 2 or rows_now["poisoned"]:
            ooms.append(rows_now["n"])
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(step_module, "run_pass", forward)
    hook = tiny_lm.model.model.layers[1].mlp.register_forward_pre_hook(mlp_hook)
    prompts = long_prompts(tiny_lm, 4) + [poisoned]
    params = greedy(8)
    try:
        got = run_engine(lambda: Engine(tiny_lm, prefill_tokens_per_step=64),
                         lambda engine: asyncio.gather(*(outcome(engine.submit(ids, params)) for ids in prompts)))
    finally:
        hook.remove()
    assert any(n > 2 for n in ooms) and 1 in ooms, ooms  # big passes were split, and the poisoned row failed alone
    assert got[:4] == [solo_tokens(tiny_lm, ids, params) for ids in prompts[:4]]
    assert isinstance(got[4], GenerationFailed) and "out of memory" in got[4].message


def test_failed_pass_is_rolled_back_exactly():
    """roll_back cuts each layer back to its length before the pass (full and sliding layers alike), and refuses
    when a sliding layer has already dropped keys it would need."""
    from transformers import MistralConfig, Qwen2Config
    from transformers import DynamicCache

    from app.core.engine.faults import cache_lengths, roll_back

    def kv(n):
        return torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4)

    for config in (Qwen2Config(num_hidden_layers=2), MistralConfig(num_hidden_layers=2, sliding_window=8)):
        cache = DynamicCache(config=config)
        for layer in range(2):
            cache.update(*kv(5), layer)
        before = [cache.layers[i].keys.clone() for i in range(2)]
        lengths = cache_lengths(cache)
        cache.update(*kv(2), 0)  # the pass failed after layer 0
        assert roll_back(cache, lengths)
        assert cache_lengths(cache) == [5, 5]
        assert all(torch.equal(cache.layers[i].keys, before[i]) for i in range(2))
    cache = DynamicCache(config=MistralConfig(num_hidden_layers=1, sliding_window=8))
    cache.update(*kv(7), 0)
    lengths = cache_lengths(cache)
    cache.update(*kv(3), 0)  # past the window: the oldest keys are gone
    assert not roll_back(cache, lengths)


# ---- the engine thread dies ----

def test_engine_thread_death_ends_every_request_cleanly(tiny_lm, monkeypatch):
    calls = {"n": 0}
    real_emit = Engine._emit

    def dying_emit(self, handle, event):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("simulated bug in _emit")
        real_emit(self, handle, event)

    monkeypatch.setattr(Engine, "_emit", dying_emit)
    prompts = [tiny_lm.encode_text(f"request {i}") for i in range(3)]

    async def scenario(engine):
        assert engine.alive
        handles = [engine.submit(ids, greedy(30)) for ids in prompts]  # two run, one waits for a slot
        results = await asyncio.gather(*(outcome(h) for h in handles))
        with pytest.raises(EngineDead):
            engine.submit(prompts[0], greedy(3))
        return results, engine.alive

    results, alive = run_engine(lambda: Engine(tiny_lm, max_active=2), scenario)
    assert all(isinstance(r, EngineDead) and "simulated bug in _emit" in r.message for r in results), results
    assert not alive


# ---- memory-aware admission ----

def test_kv_bytes_per_token_from_the_config():
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    # Qwen2.5-0.5B: 24 layers x 2 KV heads (GQA, of 14) x head_dim 64 (896 / 14) x K and V x 2 bytes = 12 KiB
    qwen25 = Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, num_hidden_layers=24)
    assert KVLayout.from_config(qwen25, torch.bfloat16).bytes_per_token == 12288
    assert KVLayout.from_config(qwen25, torch.float32).bytes_for(1000) == 24576 * 1000
    # Qwen3 gives head_dim explicitly (128, not 1024 / 16 = 64)
    qwen3 = Qwen3Config(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                        num_hidden_layers=28)
    assert KVLayout.from_config(qwen3, torch.bfloat16).bytes_per_token == 28 * 8 * 128 * 2 * 2
    # Mistral-style sliding window with no layer_types: every layer keeps at most the window
    mistral = MistralConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4,
                            sliding_window=100)
    layout = KVLayout.from_config(mistral, torch.float16)
    per_token = 4 * 2 * 32 * 2 * 2
    assert layout.bytes_for(50) == 50 * per_token and layout.bytes_for(5000) == 100 * per_token


def test_budget_reserve_release_and_reclaim():
    budget = KVBudget(1000)
    assert budget.reserve("a", 600) and not budget.reserve("b", 600)
    assert budget.in_use == 600
    evicted = []
    budget.reserve("prefix-cache", 300)
    budget.add_reclaimer(lambda need: evicted.append(budget.release("prefix-cache")),  # a cache that evicts
                         lambda: budget._held.get("prefix-cache", 0))
    assert budget.reserve("b", 300) and evicted == [300] and budget.in_use == 900
    assert budget.release("a") == 600 and budget.release("a") == 0
    assert budget.in_use == 300


def test_a_request_that_cannot_fit_even_after_eviction_leaves_the_prefix_cache_alone():
    """9,000 of 10,000 bytes held by a running request: a queued 5,000-byte request waits, asked every step,
    and the cache keeps its 500 bytes (it used to be emptied on the first ask)."""
    budget = KVBudget(10_000)
    assert budget.reserve("running", 9_000) and budget.reserve("prefix-cache", 500)
    evicted = []
    budget.add_reclaimer(lambda need: evicted.append(budget.release("prefix-cache")),
                         lambda: budget._held.get("prefix-cache", 0))
    assert not any(budget.reserve("queued", 5_000) for _ in range(4))
    assert evicted == [] and budget.in_use == 9_500
    budget.release("running")
    assert budget.reserve("queued", 5_000) and evicted == []  # fits beside the cache now
    assert budget.reserve("more", 5_000) and evicted == [500]  # evicting admits this one, so it is done


@pytest.mark.full
def test_requests_wait_for_kv_budget_and_too_big_ones_get_400(tiny_lm):
    prompts = [tiny_lm.encode_text(f"request number {i}") for i in range(3)]
    layout = KVLayout.from_config(tiny_lm.model.config, tiny_lm.dtype)
    one = max(layout.bytes_for(len(p) + 20) for p in prompts)
    order: list[str] = []

    class Recording(Engine):
        def _emit(self, handle, event):
            order.append(handle.request_id)
            super()._emit(handle, event)

    async def scenario(engine):
        with pytest.raises(InvalidRequest) as refused:
            engine.submit(prompts[0], greedy(200))  # could never fit, even in an idle engine
        handles = [engine.submit(ids, greedy(20), request_id=str(i)) for i, ids in enumerate(prompts)]
        results = await asyncio.gather(*(outcome(h) for h in handles))
        return refused.value, results, engine.kv_budget.in_use

    refused, results, reserved = run_engine(lambda: Recording(tiny_lm, kv_cache_bytes=int(1.5 * one)), scenario)
    assert refused.param == "max_tokens" and refused.code == "kv_cache_exceeded"
    assert f"{int(1.5 * one):,} bytes" in refused.message and "200 max_tokens" in refused.message
    assert results == [solo_tokens(tiny_lm, ids, greedy(20)) for ids in prompts]
    # room for one at a time: each request ran start to end before the next was admitted, though 8 slots were free
    assert order == ["0"] * 20 + ["1"] * 20 + ["2"] * 20
    assert reserved == 0


def test_default_kv_budget_is_a_fraction_of_available_ram():
    from app.core.engine.kv_budget import available_ram, default_kv_cache_bytes

    budget = default_kv_cache_bytes(torch.device("cpu"))
    assert 0 < budget <= available_ram()


def test_kv_cache_bytes_setting_takes_units():
    from app.config import Settings

    assert Settings(kv_cache_bytes="8GiB").kv_cache_bytes == 8 * 2**30
    assert Settings(kv_cache_bytes="500M").kv_cache_bytes == 500_000_000
    assert Settings(kv_cache_bytes=12345).kv_cache_bytes == 12345


@pytest.mark.real_model
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one-per-pass"])
def test_smollm_long_prompt_in_both_modes_equals_generate(smollm_fp32, packed):
    """The long-prompt reproduction: SmolLM2 in fp32, a ~300-word prompt (several 128-token prefill chunks)."""
    lm = smollm_fp32
    text = "Summarise this text. " + " ".join(f"Paris has bridge number {i} over the Seine." for i in range(40))
    ids = lm.encode_chat([{"role": "user", "content": text}])
    assert len(ids) > 3 * 128
    params = greedy(16)
    got = run_engine(lambda: Engine(lm, packed_batching=packed), lambda engine: outcome(engine.submit(ids, params)),
                     timeout=900)
    with torch.inference_mode():
        hf = lm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               do_sample=False, max_new_tokens=16, min_new_tokens=16, pad_token_id=0)
    assert got == hf[0, len(ids):].tolist()


def test_idle_engine_gives_freed_heap_back_between_bursts_only(tiny_lm, monkeypatch):
    """Once at start and once each time the work runs out, never between the steps of a busy engine."""
    import app.core.engine.engine as engine_module

    trims = []
    monkeypatch.setattr(engine_module, "release_free_heap", lambda: trims.append(1))

    async def scenario(engine):
        await asyncio.sleep(0.2)
        at_start = len(trims)
        tokens = await outcome(engine.submit(tiny_lm.encode_text("hello"), greedy(20)))
        await asyncio.sleep(0.2)
        return at_start, len(tokens), len(trims)

    at_start, n_tokens, total = run_engine(lambda: Engine(tiny_lm), scenario)
    assert at_start == 1 and n_tokens == 20 and total == 2

