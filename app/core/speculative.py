"""N-gram speculative decoding (prompt lookup): guess the next tokens by finding the request's last few tokens earlier
in its own prompt or output, and check all the guesses in one forward pass.

    1) propose: the last n tokens (n = 4, 3, 2: longest first) were seen before, most recently ending at e;
       the tokens after e, up to k of them, are the drafts. They are written after the sequence's last token as
       scratch, so the engine feeds `[last token, draft_1 .. draft_k]` as one row of k + 1 tokens.
    2) verify: the pass returns logits at all k + 1 positions. Position j chooses a token exactly as a plain decode
       step would (same processors over the prefix including the drafts accepted so far, same generator, one draw
       per emitted token). While the chosen token equals draft j + 1 it is accepted and the next position is read;
       the first token that differs (or the one after the last draft) is emitted too and ends the step.
    3) crop: the cache grew by k + 1; the keys of drafts past the last emitted token are dropped
       (`DynamicCache.crop(-n)`).

Why the output is unchanged: each emitted token is chosen from logits over exactly the tokens before it, by the
same rule and with the same draw from the request's generator as without speculation. So greedy tokens are the
same, and a seeded sampled request gets the same tokens too, up to rounding: a verify row computes the same logits
as k + 1 decode steps would, in one matrix product instead of several (tests/fast/test_speculative.py measures it).
With BATCH_INVARIANT on, exactly: each verify row attends in a call of its own, as the decode row at its position
would (app/core/runner/pieces.py), and the linears compute a row the same way at any row count.
Each token still goes through `Sequence.accept`, so EOS, max_tokens and stop strings end the step at once, and
nothing past a stop is ever emitted.

Adapting k: a draft token costs a little compute even when rejected. The drafter keeps a running estimate p of how
often a draft is accepted given the one before it was, and drafts k tokens only while the k-th one's chance of being
used, p^k, is worth its cost; at p too low it stops drafting and probes again later.
"""

from __future__ import annotations

import torch

from app.core.sequence import Sequence, TokenEvent

MIN_NGRAM, MAX_NGRAM = 2, 4  # a single matching token predicts little; vLLM and llama.cpp look up 1-5
MAX_DRAFT = 8
# What one more draft token in a verify row costs, as a fraction of a one-token decode step. On a CPU at batch 1 the
# weights are read once for the whole row, so extra tokens are cheap (Qwen2.5-0.5B bf16 here: see docs/performance.md).
DRAFT_COST = 0.1
RATE = 0.25  # how far one verified position moves the acceptance estimate
RECOVERY = 0.02  # how far a step without drafts moves it back toward 1/2, so drafting is tried again later


class NgramDrafter:
    """One request's n-gram index over its own tokens, and its acceptance estimate."""

    def __init__(self, max_draft: int = MAX_DRAFT):
        self.max_draft = max_draft
        self.history: list[int] = []  # prompt + output so far, mirrored from Sequence.token_ids
        # n-gram -> end (exclusive) of its most recent occurrence; only occurrences ending before the last token
        # are indexed, so the sequence's own suffix never matches itself
        self.index: dict[tuple[int, ...], int] = {}
        self.indexed_to = 0
        self.p = 0.5  # chance that a draft is accepted, given the one before it was

    def draft_len(self) -> int:
        k = 0
        while k < self.max_draft and self.p ** (k + 1) >= DRAFT_COST:
            k += 1
        return k

    def propose(self, seq: Sequence) -> list[int]:
        """Up to k drafts, written after the sequence's last token (scratch: not part of `seq.length`)."""
        room = seq.max_new_tokens - seq.n_generated - 1  # all k accepted plus one more must still fit
        k = min(self.draft_len(), room)
        if k <= 0:
            self._forget()  # nothing drafted: let the estimate drift back up, so drafting is tried again later
            return []
        self._sync(seq)
        history, end = self.history, len(self.history)
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            start = self.index.get(tuple(history[end - n :])) if end >= n else None
            if start is not None:
                drafts = history[start : min(start + k, end)]
                seq.token_ids[0, seq.length : seq.length + len(drafts)] = torch.tensor(drafts)
                return drafts
        return []

    def record(self, drafted: int, accepted: int) -> None:
        """A moving average over the positions read: each accepted draft, then the rejected one if any."""
        for outcome in [1.0] * accepted + ([0.0] if accepted < drafted else []):
            self.p += RATE * (outcome - self.p)

    def _forget(self) -> None:
        self.p += RECOVERY * (0.5 - self.p)

    def _sync(self, seq: Sequence) -> None:
        if len(self.history) < seq.length:
            self.history += seq.token_ids[0, len(self.history) : seq.length].tolist()
        last_end = len(self.history) - 1  # n-grams ending at the last token are indexed next time
        for end in range(self.indexed_to + 1, last_end + 1):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                self.index[tuple(self.history[end - n : end])] = end
        self.indexed_to = max(self.indexed_to, last_end)


def accept_drafts(seq: Sequence, logits: torch.Tensor, drafts: list[int]) -> tuple[list[TokenEvent], int]:
    """logits: [k + 1, vocab] at the last token and each draft -> (the emitted events, drafts accepted).

    The cache already holds the k + 1 fed tokens; what follows the last emitted token is cropped."""
    k = len(drafts)
    argmax = logits.argmax(dim=-1).tolist()  # one transfer for the whole row; used where plain greedy applies
    events: list[TokenEvent] = []
    for j in range(k + 1):
        row = logits[j : j + 1]
        forced = seq.forced_token()  # a spent thinking budget: as in choose_many, this token comes regardless
        if forced is not None:
            token, seq.stages = forced, None
        elif seq.plain_greedy:  # asked per position: a grammar, say, starts to apply once thinking ends
            token = argmax[j]
        else:
            token = int(seq.pick(row))  # processors over the prefix with the drafts accepted so far
        events.append(seq.accept(token, row))
        if events[-1].finish_reason or j == k or token != drafts[j]:
            break
    accepted = next((j for j, (e, d) in enumerate(zip(events, drafts)) if e.token_id != d), min(len(events), k))
    unused = k + 1 - len(events)  # fed tokens after the last emitted one
    if unused:
        seq.cache.crop(-unused)
    if seq.drafter is not None:
        seq.drafter.record(k, accepted)
    return events, accepted
