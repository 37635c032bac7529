"""A preamble: a free part at the start of an answer that ends at a marker, with an optional token budget.

A reasoning model (Qwen3) thinks before it answers, and its thinking ends at `</think>`. Two rules hang on that:
- a budget: after `budget` generated tokens, if the end marker has not appeared, the engine inserts `forced_ids`
  (the marker and what the model's template writes after it) and the answer follows;
- constraints (a grammar) apply to the answer only, so they wait until the preamble has ended.
The engine knows only token ids; which model thinks and with which tags is the wire layer's business.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preamble:
    end_ids: tuple[int, ...]  # the marker that ends the preamble, e.g. the id of "</think>"
    budget: int | None = None  # generated tokens allowed before `forced_ids` are inserted; None: no limit
    forced_ids: tuple[int, ...] = ()  # inserted when the budget runs out; must contain `end_ids`

    def __post_init__(self) -> None:
        if not self.end_ids:
            raise ValueError("a preamble needs an end marker")
        if self.budget is not None and not _contains(self.forced_ids, self.end_ids):
            raise ValueError("forced_ids must contain the end marker, or the preamble would never end")


class PreambleState:
    """Follows one sequence's output: has the preamble ended, and which token (if any) must come next."""

    def __init__(self, preamble: Preamble):
        self.preamble = preamble
        self.ended = False
        self.queue: list[int] = []  # forced tokens still to be emitted
        self.recent: list[int] = []  # the last len(end_ids) tokens, to spot the marker
        self._check_budget(0)

    def forced_token(self) -> int | None:
        return self.queue[0] if self.queue else None

    def observe(self, token_id: int, n_generated: int) -> None:
        """`token_id` was just appended; `n_generated` counts it."""
        if self.queue and token_id == self.queue[0]:
            self.queue.pop(0)
        n = len(self.preamble.end_ids)
        self.recent = (self.recent + [token_id])[-n:]
        if not self.ended and tuple(self.recent) == self.preamble.end_ids:
            self.ended = True  # a forced marker keeps its queue: what follows it is still inserted
        self._check_budget(n_generated)

    def _check_budget(self, n_generated: int) -> None:
        budget = self.preamble.budget
        if not self.ended and not self.queue and budget is not None and n_generated >= budget:
            self.queue = list(self.preamble.forced_ids)


def _contains(haystack: tuple[int, ...], needle: tuple[int, ...]) -> bool:
    return any(haystack[i : i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))
