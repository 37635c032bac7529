"""Mistral's Magistral: `[THINK]…[/THINK]`, written by the model when its system prompt asks it to think.

As vLLM's mistral reasoning parser: an answer that starts with `[THINK]` is reasoning up to `[/THINK]` (all of it if
`[/THINK]` never comes) and content after; an answer that does not start with it is all content. Both markers are
special tokens in Magistral's tokenizer, so decoding drops them: the splitter puts them back from the token ids.
Unlike vLLM we look for `[THINK]` only at the start of the answer, where Magistral writes it, so a `[THINK]` quoted
in the answer stays content. Picked when the template mentions `[THINK]` and `[/THINK]` is a token.
"""

from __future__ import annotations

from functools import partial

from app.openai.reasoning.base import ReasoningFormat, budget_ids, has_token, special_markers
from app.openai.reasoning.tagged import TaggedSplitter

NAME = "magistral"
OPEN, CLOSE = "[THINK]", "[/THINK]"


def detect(tokenizer, template: str) -> bool:
    return OPEN in template and has_token(tokenizer, CLOSE)


def build(tokenizer) -> ReasoningFormat:
    end_ids, forced_ids = budget_ids(tokenizer, CLOSE)  # Magistral answers right after [/THINK]
    return ReasoningFormat(NAME, end_ids, forced_ids, partial(splitter, (OPEN,), (CLOSE,)),
                           markers=special_markers(tokenizer, (OPEN, CLOSE)))


def splitter(opens, closes, thinking: bool, markers: dict[int, str]) -> TaggedSplitter:
    return TaggedSplitter(opens, closes, opened_by_template=False, thinking=thinking, markers=markers)
