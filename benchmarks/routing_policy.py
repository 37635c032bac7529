"""The pieces of `bench routing` that need no server: the multi-turn trace, the picker's prefix index, the policies.

The prefix-aware policy is a small copy of what the Gateway API Inference Extension's endpoint picker does with
its default scorers, computed from the same inputs: each replica's own /metrics, and a prefix index the router
keeps itself. Its score for a replica is the sum of

    prefix    the share of the prompt's leading 64-character blocks that the router has sent to this replica
              before (the picker's `prefix-cache-scorer`), discounted by how often this replica's own prefix-hit
              counter has borne such guesses out
    queue     fewer requests waiting scores higher, scaled from 0 to 1 across the replicas (`queue-scorer`)
    kv        1 - KV-cache usage (`kv-cache-utilization-scorer`)

and the highest total wins (`max-score-picker`). Ties go to the replica running fewer requests, then to a seeded
random choice. (Running requests are only a tie-break, as in the picker: our server batches up to MAX_ACTIVE
requests, so a running request slows the others a little, while a waiting one delays the next by a whole turn.)

What the prefix index approximates: the replica's prefix cache (app/core/engine/prefix_cache.py), which it cannot see.
It assumes that (1) a prompt sent to a replica is cached there until the replica has been sent `capacity` newer
blocks (an LRU per replica sized like the server's prefix cache), (2) a 64-character block is about one 16-token
cache block, and (3) a shared text prefix is a shared token prefix. All three fail at the edges (evictions forced
by running requests, CJK text, a tokenizer merging across a block boundary), which is why the replica's measured
hit counter is used to discount it.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass

HASH_BLOCK_CHARS = 64  # the picker's default hashBlockSize
TOPICS = ("a travel agency booking trains and hotels across Europe", "a bank's support desk for card payments",
          "a hospital's appointment line", "a software company's help desk for its database product",
          "a bicycle shop that repairs and sells e-bikes", "a university's admissions office")
RULES = ("Answer in at most two sentences.", "Never invent prices or dates; say when you do not know.",
         "Ask one clarifying question when the request is ambiguous.", "Use the customer's own words.",
         "Do not give legal or medical advice.", "Offer to hand over to a human after two failed attempts.",
         "Keep a friendly, plain tone.", "Quote reference numbers exactly as written.")
QUESTIONS = ("What can you help me with today?", "I need to change my booking for next Tuesday.",
             "Why was my payment declined twice?", "Can I speak to someone about my last invoice?",
             "How long does a repair usually take?", "What documents should I bring with me?",
             "Is there a cheaper option?", "Can you explain that again more simply?")
REPLIES = ("Of course, I can help with that.", "Let me check that for you.", "Thanks, that is clear now.",
           "I understand; here is what we can do.")


@dataclass(frozen=True)
class TraceRequest:
    at: float  # seconds after the start of the replay
    conversation: int
    turn: int  # 0: the first message of the conversation
    system: int  # which shared system prompt
    messages: tuple[tuple[str, str], ...]  # (role, content), the whole history so far

    def as_messages(self) -> list[dict]:
        return [{"role": role, "content": content} for role, content in self.messages]


def system_prompt(index: int, rules: int) -> str:
    """A long, distinct system prompt: a role and a numbered list of house rules, about 60 characters each."""
    rng = random.Random(index)
    # The desk number comes first, so that no two system prompts share even their first 64-character block.
    lines = [f"Desk {index}. You are the assistant of {TOPICS[index % len(TOPICS)]}."]
    lines += [f"Rule {i + 1}: {rng.choice(RULES)}" for i in range(rules)]
    return "\n".join(lines)


def make_trace(conversations: int, turns: int, systems: int, rate: float, turn_gap: float, rules: int = 30,
               seed: int = 0) -> list[TraceRequest]:
    """Multi-turn chats over a few shared system prompts, in arrival order.

    Conversation c starts at a Poisson arrival (`rate` new conversations per second) with system prompt
    c % systems, and sends a follow-up every `turn_gap` seconds: the whole history so far (the earlier questions
    and a canned reply to each), then a new question. So a follow-up extends its own earlier prompt, and every
    conversation shares its system prompt with the others of its kind. The replies are canned rather than the
    model's, so the trace is the same whatever the model says.
    """
    if min(conversations, turns, systems) < 1 or rate <= 0 or turn_gap < 0:
        raise ValueError("conversations, turns and systems must be >= 1, rate > 0 and turn_gap >= 0")
    rng = random.Random(seed)
    prompts = [system_prompt(i, rules) for i in range(systems)]
    out, start = [], 0.0
    for c in range(conversations):
        start += rng.expovariate(rate)
        history: list[tuple[str, str]] = [("system", prompts[c % systems])]
        for t in range(turns):
            history.append(("user", f"[customer {c}] {rng.choice(QUESTIONS)}"))
            out.append(TraceRequest(start + t * turn_gap, c, t, c % systems, tuple(history)))
            history.append(("assistant", rng.choice(REPLIES)))
    return sorted(out, key=lambda r: (r.at, r.conversation))


def prompt_text(messages) -> str:
    """What the router hashes: the messages in order, as a chat template lays them out (role, then content)."""
    return "".join(f"<{m['role']}>\n{m['content']}\n" for m in messages)


def block_hashes(text: str, block_chars: int = HASH_BLOCK_CHARS) -> list[bytes]:
    """Chained hashes of the text's whole blocks: block i's hash covers blocks 0..i, so blocks only match in
    order from the start, as a prefix cache's do. A last partial block is not counted (nor cached)."""
    out, previous = [], b""
    for i in range(len(text) // block_chars):
        previous = hashlib.blake2b(previous + text[i * block_chars:(i + 1) * block_chars].encode(),
                                   digest_size=8).digest()
        out.append(previous)
    return out


class PrefixIndex:
    """Per replica, an LRU of the block hashes the router has sent there, at most `capacity` blocks each."""

    def __init__(self, replicas: int, capacity: int):
        self.capacity = capacity
        self.blocks: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(replicas)]

    def matched(self, replica: int, hashes: list[bytes]) -> int:
        """How many of the leading blocks the replica is believed to hold."""
        held, n = self.blocks[replica], 0
        while n < len(hashes) and hashes[n] in held:
            n += 1
        return n

    def record(self, replica: int, hashes: list[bytes]) -> None:
        held = self.blocks[replica]
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)


@dataclass
class ReplicaView:
    """One replica as its /metrics shows it (app/gateway_metrics.py)."""

    waiting: float = 0.0  # simple_serve_queue_depth
    running: float = 0.0  # simple_serve_active_sequences
    kv_usage: float = 0.0  # simple_serve_kv_cache_usage_ratio, 0..1
    hit_tokens: float = 0.0  # simple_serve_prefix_cache_hit_tokens_total
    queried_tokens: float = 0.0  # simple_serve_prefix_cache_queried_tokens_total

    @classmethod
    def from_samples(cls, m: dict[str, float]) -> ReplicaView:
        return cls(m.get("simple_serve_queue_depth", 0.0), m.get("simple_serve_active_sequences", 0.0),
                   m.get("simple_serve_kv_cache_usage_ratio", 0.0),
                   m.get("simple_serve_prefix_cache_hit_tokens_total", 0.0),
                   m.get("simple_serve_prefix_cache_queried_tokens_total", 0.0))


class RoundRobin:
    name = "round-robin"

    def __init__(self, replicas: int):
        self.replicas, self.next = replicas, 0

    def choose(self, messages, views: list[ReplicaView]) -> int:
        chosen, self.next = self.next, (self.next + 1) % self.replicas
        return chosen


class PrefixAware:
    name = "prefix-aware"

    def __init__(self, replicas: int, capacity: int, seed: int = 0,
                 weights: tuple[float, float, float] = (1.0, 1.0, 1.0)):
        """`capacity`: blocks per replica in the prefix index; `weights`: of the prefix, queue and kv scores."""
        self.weights = weights
        self.index = PrefixIndex(replicas, capacity)
        self.predicted = [0.0] * replicas  # per replica: the matched share the index predicted, summed
        self.sent = [0] * replicas  # per replica: requests sent
        self.rng = random.Random(seed)

    def trust(self, replica: int, view: ReplicaView) -> float:
        """How far this replica's measured hit rate bears out the index's guesses, 0..1 (1 until measured)."""
        if self.predicted[replica] <= 0 or view.queried_tokens <= 0:
            return 1.0
        expected = self.predicted[replica] / self.sent[replica]
        return min(1.0, (view.hit_tokens / view.queried_tokens) / expected)

    def scores(self, hashes: list[bytes], views: list[ReplicaView]) -> list[float]:
        w_prefix, w_queue, w_kv = self.weights
        low, high = min(v.waiting for v in views), max(v.waiting for v in views)
        out = []
        for r, view in enumerate(views):
            prefix = self.index.matched(r, hashes) / len(hashes) if hashes else 0.0
            queue = 1.0 if high == low else (high - view.waiting) / (high - low)
            out.append(w_prefix * prefix * self.trust(r, view) + w_queue * queue + w_kv * (1.0 - view.kv_usage))
        return out

    def choose(self, messages, views: list[ReplicaView]) -> int:
        hashes = block_hashes(prompt_text(messages))
        scores = self.scores(hashes, views)
        best = max(scores)
        tied = [r for r, s in enumerate(scores) if s >= best - 1e-9]
        fewest = min(views[r].running for r in tied)
        chosen = self.rng.choice([r for r in tied if views[r].running == fewest])
        if hashes:
            self.predicted[chosen] += self.index.matched(chosen, hashes) / len(hashes)
            self.sent[chosen] += 1
        self.index.record(chosen, hashes)
        return chosen


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]
