"""`bench routing`: the trace generator and the routing policies without servers, then one short real run."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from benchmarks.routing_policy import (HASH_BLOCK_CHARS, PrefixAware, PrefixIndex, ReplicaView, RoundRobin,
                                      block_hashes, make_trace, percentile, prompt_text)


def test_trace_has_shared_system_prompts_and_follow_ups_that_extend_their_conversation():
    trace = make_trace(conversations=6, turns=3, systems=2, rate=1.0, turn_gap=5.0, rules=4, seed=1)
    assert len(trace) == 18
    assert [r.at for r in trace] == sorted(r.at for r in trace)
    by_conversation = {}
    for r in trace:
        by_conversation.setdefault(r.conversation, []).append(r)
    for c, turns in by_conversation.items():
        assert [t.turn for t in turns] == [0, 1, 2]
        assert {t.system for t in turns} == {c % 2}
        for earlier, later in zip(turns, turns[1:]):
            # a follow-up is the earlier prompt, a reply to it, then a new question
            assert later.messages[:len(earlier.messages)] == earlier.messages
            assert [role for role, _ in later.messages[len(earlier.messages):]] == ["assistant", "user"]
            assert later.at - earlier.at == pytest.approx(5.0)
    systems = {r.system: r.messages[0] for r in trace}
    assert systems[0] != systems[1] and all(m[0] == "system" for m in systems.values())
    assert all(r.messages[0] == systems[r.system] for r in trace), "every conversation shares its system prompt"
    assert make_trace(6, 3, 2, 1.0, 5.0, rules=4, seed=1) == trace, "same seed, same trace"
    with pytest.raises(ValueError):
        make_trace(0, 3, 2, 1.0, 5.0)


def test_block_hashes_are_chained_so_only_a_common_prefix_matches():
    a = "x" * HASH_BLOCK_CHARS + "y" * HASH_BLOCK_CHARS
    b = "z" * HASH_BLOCK_CHARS + "y" * HASH_BLOCK_CHARS  # same second block, different first
    assert len(block_hashes(a)) == 2 and len(block_hashes(a[:-1])) == 1, "a partial last block is not counted"
    assert block_hashes(a)[1] != block_hashes(b)[1]
    assert block_hashes(a + "more text")[:2] == block_hashes(a)


def test_prefix_index_forgets_least_recently_sent_blocks():
    index = PrefixIndex(replicas=2, capacity=3)
    first, second = block_hashes("a" * 128), block_hashes("b" * 128)
    index.record(0, first)
    assert index.matched(0, first) == 2 and index.matched(1, first) == 0
    index.record(0, second)  # 4 blocks into room for 3: the oldest of `first` goes
    assert index.matched(0, second) == 2 and index.matched(0, first) == 0


def messages(system: str, question: str = "hi") -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def test_round_robin_ignores_everything():
    policy = RoundRobin(3)
    idle = [ReplicaView()] * 3
    assert [policy.choose(messages("s"), idle) for _ in range(5)] == [0, 1, 2, 0, 1]


def test_prefix_aware_follows_the_prefix_and_spreads_new_ones():
    policy = PrefixAware(replicas=2, capacity=1000, seed=0)
    long_a, long_b = "A" * 640, "B" * 640
    first = policy.choose(messages(long_a), [ReplicaView(), ReplicaView()])
    # a new prefix, with the first replica now busy: the tie-break sends it to the idle one
    busy = [ReplicaView(running=1), ReplicaView()] if first == 0 else [ReplicaView(), ReplicaView(running=1)]
    second = policy.choose(messages(long_b), busy)
    assert second != first
    # follow-ups go where their prefix went, though that replica is running more
    both_busy = [ReplicaView(running=3), ReplicaView(running=1)]
    assert policy.choose(messages(long_a, "and then?"), both_busy) == first
    assert policy.choose(messages(long_b, "and then?"), both_busy) == second


def test_prefix_aware_leaves_a_replica_whose_queue_or_kv_cache_is_full():
    policy = PrefixAware(replicas=2, capacity=1000, seed=0)
    home = policy.choose(messages("A" * 640), [ReplicaView(), ReplicaView()])
    other = 1 - home
    queued = [ReplicaView(), ReplicaView()]
    queued[home] = ReplicaView(waiting=4, running=8)
    assert policy.choose(messages("A" * 640, "again"), queued) == other, "a queue outweighs a cached prefix"
    policy = PrefixAware(replicas=2, capacity=1000, seed=0)  # anew: the request above taught it `other` too
    home = policy.choose(messages("A" * 640), [ReplicaView(), ReplicaView()])
    other = 1 - home
    full = [ReplicaView(), ReplicaView()]
    full[home] = ReplicaView(kv_usage=1.0)
    scores = policy.scores(block_hashes(prompt_text(messages("A" * 640))), full)
    assert scores[home] == pytest.approx(scores[other]), "a full KV cache costs as much as a full prefix match gains"


def test_prefix_aware_discounts_a_replica_whose_hits_do_not_bear_the_index_out():
    policy = PrefixAware(replicas=2, capacity=1000, seed=0)
    home = policy.choose(messages("A" * 640), [ReplicaView(), ReplicaView()])
    policy.choose(messages("A" * 640, "again"), [ReplicaView(), ReplicaView()])  # predicted: a near-full hit
    hashes = block_hashes(prompt_text(messages("A" * 640, "third")))
    believed, evicting = [ReplicaView(), ReplicaView()], [ReplicaView(), ReplicaView()]
    believed[home] = ReplicaView(hit_tokens=100, queried_tokens=200)  # what the index predicted: 1 of 2 hit
    evicting[home] = ReplicaView(hit_tokens=0, queried_tokens=200)  # the replica evicted what we sent it
    assert policy.trust(home, believed[home]) == pytest.approx(1.0)
    assert policy.trust(home, evicting[home]) == 0.0
    assert policy.scores(hashes, evicting)[home] < policy.scores(hashes, believed)[home]


def test_percentile_is_nearest_rank():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([5.0], 99) == 5.0


@pytest.mark.server
def test_a_short_routing_run_end_to_end(tmp_path, capsys):
    """Two real replicas of SmolLM2-135M, a 6-request trace, both policies: a JSON report and a table."""
    from benchmarks import routing

    parser = argparse.ArgumentParser()
    routing.add_arguments(parser)
    args = parser.parse_args(["--conversations", "3", "--turns", "2", "--systems", "2", "--rules", "6",
                              "--rate", "4", "--turn-gap", "2", "--max-tokens", "2", "--out", str(tmp_path / "r.json")])
    report = routing.run(args)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["policies"].keys() == {"round-robin", "prefix-aware"} == report["policies"].keys()
    for result in saved["policies"].values():
        assert result["errors"] == [] and result["ttft_s"]["n"] == 6 and sum(result["per_replica"]) == 6
        assert 0.0 <= result["prefix_hit_rate"] <= 1.0 and result["ttft_s"]["p50"] <= result["ttft_s"]["p99"]
    table = capsys.readouterr().out
    assert "round-robin" in table and "prefix-aware" in table and "TTFT p99" in table
