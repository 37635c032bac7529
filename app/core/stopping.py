"""When a sequence ends: an EOS id, the token budget, or a stop string.

Stop strings are matched on text, not tokens, because a string like "\n\n" can be split across tokens in many ways.
`StopStringFilter` holds back any tail of the text that could still grow into a stop string, so a client never sees
the start of a stop string that later completes (litgpt and vLLM do the same).

Special tokens (`<|im_end|>`, `<|endoftext|>`) are never in the decoded text, so a stop string that names one is
matched as its token id instead (`special_stop_ids`), next to vLLM's `stop_token_ids`.
"""

from __future__ import annotations

from typing import Iterable


def special_stop_ids(tokenizer, stops: Iterable[str]) -> frozenset[int]:
    """Ids of the special tokens that some stop string names exactly: decoding skips them, so only ids can match."""
    wanted = set(stops)
    added = getattr(tokenizer, "added_tokens_decoder", {})  # {id: AddedToken}
    return frozenset(i for i, token in added.items() if token.special and token.content in wanted)


def token_finish_reason(token_id: int, n_generated: int, max_tokens: int, eos_ids: frozenset[int],
                        min_tokens: int = 0, ignore_eos: bool = False,
                        stop_ids: frozenset[int] = frozenset()) -> str | None:
    """`n_generated` counts this token. EOS or a stop id gives "stop"; running out of budget gives "length".
    `ignore_eos` ignores only the model's EOS: stop ids are the request's own."""
    if n_generated >= min_tokens and (token_id in stop_ids or token_id in eos_ids and not ignore_eos):
        return "stop"
    if n_generated >= max_tokens:
        return "length"
    return None


class StopStringFilter:
    """Feeds on text deltas; returns the part that is safe to show and whether a stop string matched."""

    def __init__(self, stops: Iterable[str]):
        self.stops = tuple(stops)
        self.pending = ""  # text that could still be the start of a stop string
        self.matched: str | None = None  # the stop string that ended the text (Anthropic's `stop_sequence`)

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        self.pending += text
        # The stop that completes first wins (generation stops right there), whatever the token split: with stops
        # "abcd" and "c", the text "abcd" shows "ab" whether it arrives as "abc"+"d" or in one piece. Among stops that
        # complete at the same character the earliest start wins: "xab" with stops "b" and "ab" shows "x".
        matches = [(i + len(s), i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if matches:
            _, start, self.matched = min(matches)
            safe, self.pending = self.pending[:start], ""
            return safe, True
        hold = self._longest_tail_that_starts_a_stop()
        safe, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        return safe, False

    def flush(self) -> str:
        """At the end of generation the held tail never became a stop string, so it is real output."""
        rest, self.pending = self.pending, ""
        return rest

    def _longest_tail_that_starts_a_stop(self) -> int:
        longest = min(len(self.pending), max(len(s) for s in self.stops) - 1)
        firsts = {s[0] for s in self.stops}
        for k in range(longest, 0, -1):
            tail = self.pending[-k:]
            # the first-character test keeps this near O(L) per token for the usual text
            if tail[0] in firsts and any(s.startswith(tail) for s in self.stops):
                return k
        return 0
