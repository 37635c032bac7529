"""One request must not hold back, pin or kill the others (issue 34): a short prompt behind a long one gets its
first token without waiting for the long prompt's whole prefill; a failed row's error does not keep its batch's
caches alive; a prefix-cache copy that fails ends only its request; under tensor parallelism, a pass that raises
on rank 0 fails only its requests while the ranks stay in step. On the tiny model, through the engine."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import random
import threading
import time
import weakref

import pytest
import torch

from app.structured.grammars import Grammars
from app.core.engine.engine import Engine, EngineDead, GenerationFailed
from app.core.sampling import SamplingParams
from app.core.engine.step import share_prefill
from app.core.engine.tensor_parallel import follow
from app.errors import InvalidRequest

from test_engine import greedy, outcome, run_engine, solo_tokens
from test_grammar_limits import DEAD_END
from test_tensor_parallel import ListRanks


# ---- prefill shared fairly (finding 4) ----

def test_the_prefill_budget_goes_to_the_shortest_first_and_the_oldest_keeps_a_quarter():
    assert share_prefill(128, [7000, 3]) == [32, 3]  # the short prompt is done in one short step
    assert share_prefill(128, [7000, 5000]) == [32, 96]  # no prompt finishes: the whole budget prefills
    assert share_prefill(16, [20, 20, 20, 20]) == [16, 0, 0, 0]  # a burst of equals: first come, first served
    assert share_prefill(128, [125] * 8) == [125, 3] + [0] * 6  # a long step anyway: topped up
    assert share_prefill(128, [7000, 3, 3]) == [32, 3, 3]
    assert share_prefill(128, [5000, 100, 100]) == [32, 96, 0]  # a stream of short ones cannot starve the oldest
    assert share_prefill(128, []) == []
    rng = random.Random(0)
    for _ in range(2000):
        budget, left = rng.randint(16, 512), [rng.randint(1, 3000) for _ in range(rng.randint(1, 8))]
        shares = share_prefill(budget, left)
        assert all(0 <= s <= need for s, need in zip(shares, left))
        assert sum(shares) <= budget
        # the budget is used up, unless prompts of fewer than half its tokens end this step (it stays short)
        finishing = sum(s for s, need in zip(shares, left) if 0 < s == need)
        assert sum(shares) == min(budget, sum(left)) or 0 < finishing < budget // 2
        assert shares[0] >= min(left[0], budget // 4)
        fits = [i for i, need in enumerate(left) if need <= (budget - budget // 4) // len(left)]
        assert all(shares[i] == left[i] for i in fits)  # a short enough prompt finishes in this step


class PausingEngine(Engine):
    """Counts steps, notes the step in which each request started and got its first token, and stops after step
    `pause_after` until the test says go on (so a request can arrive mid-prefill, whatever the machine's speed)."""

    def __init__(self, *args, pause_after: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps, self.pause_after = 0, pause_after
        self.paused, self.go_on = threading.Event(), threading.Event()
        self.started_at: dict[str, int] = {}
        self.first_token_at: dict[str, int] = {}

    def _replace(self, handle, seq):
        self.started_at.setdefault(handle.request_id, self.steps)
        super()._replace(handle, seq)

    def _emit(self, handle, event):
        self.first_token_at.setdefault(handle.request_id, self.steps)
        super()._emit(handle, event)

    def _update_kv_in_use(self):
        super()._update_kv_in_use()
        self.steps += 1
        if self.steps == self.pause_after:
            self.paused.set()
            self.go_on.wait(timeout=60)


@pytest.mark.full
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one-per-pass"])
def test_a_short_prompt_arriving_behind_a_long_one_gets_its_first_token_in_its_first_step(tiny_lm, packed):
    """A 200-token prompt takes 13 steps at 16 prompt tokens a step; a 3-token prompt sent during its third step
    gets its first token from the first step it is in (before: only after the long prompt's whole prefill), and
    both get exactly their solo tokens."""
    long_ids = (tiny_lm.encode_text("Paris is a city on the Seine, with many bridges and museums. " * 20))[:200]
    short_ids = tiny_lm.encode_text("Hello there")[:3]
    assert len(long_ids) == 200 and len(short_ids) == 3

    async def scenario(engine):
        long_result = asyncio.ensure_future(outcome(engine.submit(long_ids, greedy(8), request_id="long")))
        await asyncio.to_thread(engine.paused.wait, 60)
        short_result = asyncio.ensure_future(outcome(engine.submit(short_ids, greedy(8), request_id="short")))
        engine.go_on.set()
        return await long_result, await short_result

    engine_box = []

    def factory():
        engine_box.append(PausingEngine(tiny_lm, pause_after=3, prefill_tokens_per_step=16, packed_batching=packed))
        return engine_box[0]

    long_tokens, short_tokens = run_engine(factory, scenario)
    engine = engine_box[0]
    assert engine.started_at["short"] == 3  # admitted at the first step after it arrived
    assert engine.first_token_at["short"] == engine.started_at["short"], (engine.started_at, engine.first_token_at)
    assert engine.first_token_at["long"] >= 200 // 16  # the long prompt still took its many steps
    assert long_tokens == solo_tokens(tiny_lm, long_ids, greedy(8))
    assert short_tokens == solo_tokens(tiny_lm, short_ids, greedy(8))


# ---- a failed row's error pins nothing (finding 8) ----

class WatchingEngine(Engine):
    """Keeps a weak reference to every request's Sequence."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sequences: list[weakref.ref] = []

    def _replace(self, handle, seq):
        self.sequences.append(weakref.ref(seq))
        super()._replace(handle, seq)


@pytest.mark.full
def test_a_dead_end_rows_error_does_not_keep_its_neighbours_caches_alive(tiny_lm):
    """With the garbage collector off, every Sequence of a pass in which one row reached a grammar dead end is
    freed once the requests end, by reference counting alone: the error the caller holds carries no frames."""
    grammars = Grammars(tiny_lm.tokenizer, tiny_lm.vocab_size, tiny_lm.eos_ids)
    dead_end = grammars.json_schema(DEAD_END)
    grammars.close()
    prompt = tiny_lm.encode_chat([{"role": "user", "content": "Hello there"}])
    params = [greedy(6), greedy(6), SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=6, grammar=dead_end, temperature=1.0, seed=1)]

    async def scenario(engine):
        results = await asyncio.gather(*(outcome(engine.submit(prompt, p)) for p in params))
        deadline = time.monotonic() + 10  # the worker ends its step after the last token went out
        while any(ref() is not None for ref in engine.sequences) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return results, [ref() is None for ref in engine.sequences]

    gc.collect()
    gc.disable()
    try:
        results, freed = run_engine(lambda: WatchingEngine(tiny_lm, max_active=4), scenario)
    finally:
        gc.enable()
    assert [len(r) for r in results[:3]] == [6, 6, 6]
    assert isinstance(results[3], InvalidRequest) and results[3].code == "grammar_dead_end"
    assert len(freed) == 4 and all(freed), freed


# ---- a prefix-cache copy that fails ends only its request (finding 10) ----

def test_a_failing_prefix_cache_copy_fails_only_its_request(tiny_lm, monkeypatch):
    """The copy of a cached prefix runs out of memory for one request: that request ends with a clean error,
    the engine thread lives on, and the next request is served."""
    from app.core.engine.prefix_cache import PrefixCache

    real_load, prompt = PrefixCache.load, tiny_lm.encode_text("Paris is a city on the Seine, with many bridges.")
    poisoned = {"on": False}

    def load(self, blocks, config, limit=None):
        if poisoned["on"]:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory (simulated)")
        return real_load(self, blocks, config, limit)

    monkeypatch.setattr(PrefixCache, "load", load)

    async def scenario(engine):
        first = await outcome(engine.submit(prompt, greedy(4)))  # its KV is cached at its end
        poisoned["on"] = True
        failed = await outcome(engine.submit(prompt, greedy(4)))
        poisoned["on"] = False
        after = await outcome(engine.submit(prompt, greedy(4)))
        return first, failed, after, engine.alive

    first, failed, after, alive = run_engine(lambda: Engine(tiny_lm, prefix_cache_bytes=2**22), scenario)
    assert isinstance(failed, GenerationFailed) and "can't allocate memory" in failed.message
    assert alive and first == after == solo_tokens(tiny_lm, prompt, greedy(4))


# ---- tensor parallel: rank 0 survives one pass's exception (finding 10) ----

class SyncingRanks(ListRanks):
    """ListRanks with the barrier: `stuck` makes it fail, as when a follower never left the failed pass."""

    def __init__(self, messages=None, stuck: bool = False):
        super().__init__(messages)
        self.stuck = stuck

    def sync(self) -> None:
        if self.stuck:
            self.lost = "RuntimeError: Rank 1 failed to pass monitoredBarrier (simulated)"
            raise RuntimeError(self.lost)
        if self.rank == 0:
            self.sent.append(("sync",))


def poison_forward(monkeypatch, poisoned: list[int]) -> None:
    """Every packed pass that feeds the poisoned prompt raises, on whichever rank runs it."""
    import app.core.engine.step as step_module
    import app.core.engine.tensor_parallel as tp_module

    real = step_module.run_pass

    def forward(model, work, *n_out):
        if any(seq.token_ids[0, : seq.prompt_len].tolist() == poisoned for seq, _ in work):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, work, *n_out)

    monkeypatch.setattr(step_module, "run_pass", forward)
    monkeypatch.setattr(tp_module, "run_pass", forward)


@pytest.mark.full
def test_a_pass_that_raises_on_rank_0_fails_only_its_request_and_the_follower_stays_in_step(tiny_lm, monkeypatch):
    poisoned = tiny_lm.encode_text("this prompt runs out of memory on every rank")
    poison_forward(monkeypatch, poisoned)
    prompts = [tiny_lm.encode_text("a healthy prompt"), poisoned, tiny_lm.encode_text("another healthy one")]
    ranks = SyncingRanks()

    async def scenario(engine):
        results = await asyncio.gather(*(outcome(engine.submit(ids, greedy(10))) for ids in prompts))
        return results, await outcome(engine.submit(prompts[0], greedy(5))), engine.alive

    results, after, alive = run_engine(lambda: Engine(dataclasses.replace(tiny_lm, ranks=ranks)), scenario)
    assert alive and after == solo_tokens(tiny_lm, prompts[0], greedy(5))
    assert results[0] == solo_tokens(tiny_lm, prompts[0], greedy(10))
    assert results[2] == solo_tokens(tiny_lm, prompts[2], greedy(10))
    assert isinstance(results[1], GenerationFailed) and "out of memory" in results[1].message
    assert ("sync",) in ranks.sent
    # The follower replays every message, its own passes with the poisoned row raising too; `Mirror.feed` raises
    # if any cache is out of step with rank 0's, so replaying to the end is the check.
    follow(dataclasses.replace(tiny_lm, ranks=SyncingRanks(ranks.sent)))


def test_a_follower_that_does_not_come_back_in_step_still_ends_the_engine_cleanly(tiny_lm, monkeypatch):
    poisoned = tiny_lm.encode_text("this prompt runs out of memory on rank 0")
    poison_forward(monkeypatch, poisoned)
    ranks = SyncingRanks(stuck=True)

    async def scenario(engine):
        failed = await outcome(engine.submit(poisoned, greedy(4)))
        with pytest.raises(EngineDead):
            engine.submit(poisoned, greedy(4))
        return failed, engine.alive

    failed, alive = run_engine(lambda: Engine(dataclasses.replace(tiny_lm, ranks=ranks)), scenario)
    assert isinstance(failed, EngineDead) and "did not come back in step" in failed.message and not alive
