"""Qwen3 (and Qwen3-MoE): `<think>…</think>`, switched off by the template's `enable_thinking`.

As vLLM's qwen3 reasoning parser: with thinking on, a generated `<think>` is dropped and the text up to `</think>`
is reasoning (all of it, if `</think>` never comes); with thinking off (`chat_template_kwargs:
{"enable_thinking": false}`, or `reasoning_effort: "none"`), the template writes an empty think block into the
prompt and everything is content. Picked when the template reads `enable_thinking` and `</think>` is one token.
"""

from __future__ import annotations

from functools import partial

from app.openai.reasoning.base import ReasoningFormat, budget_ids, has_token, special_markers
from app.openai.reasoning.tagged import TaggedSplitter

NAME = "qwen3"
OPEN, CLOSE = "<think>", "</think>"


def detect(tokenizer, template: str) -> bool:
    return CLOSE in template and "enable_thinking" in template and has_token(tokenizer, CLOSE)


def thinks(template_kwargs: dict) -> bool:
    return template_kwargs.get("enable_thinking", True) is not False


def build(tokenizer) -> ReasoningFormat:
    # Qwen3's template closes a thought with "</think>\n\n" before the answer; the budget forces exactly that.
    end_ids, forced_ids = budget_ids(tokenizer, CLOSE, after="\n\n")
    return ReasoningFormat(NAME, end_ids, forced_ids, partial(splitter, (OPEN,), (CLOSE,)), thinks,
                           special_markers(tokenizer, (OPEN, CLOSE)))


def splitter(opens, closes, thinking: bool, markers: dict[int, str]) -> TaggedSplitter:
    return TaggedSplitter(opens, closes, opened_by_template=True, thinking=thinking, markers=markers)
