"""DeepSeek-R1 and its distills (also QwQ and Qwen3's thinking-only releases): `<think>` opened by the template.

The generation prompt ends with `<think>\\n`, so the answer starts inside the thinking and ends it at `</think>`; a
model that writes `<think>` itself anyway has it dropped, and an answer cut off before `</think>` is all reasoning
(vLLM's deepseek_r1 parser). These templates have no switch to turn thinking off, so `reasoning_effort: "none"` is a
budget of 0: the engine writes `</think>` at once. DeepSeek-V3.1's template has one (`thinking`, off unless set):
then a request thinks only with `chat_template_kwargs: {"thinking": true}`. Picked when `</think>` is one token and
the template writes think tags but has no `enable_thinking` (that is qwen3).
"""

from __future__ import annotations

import re
from functools import partial

from app.openai.reasoning.base import ReasoningFormat, budget_ids, has_token, special_markers
from app.openai.reasoning.qwen3 import CLOSE, OPEN, splitter

NAME = "deepseek_r1"
THINKING_SWITCH = re.compile(r"\bthinking\s+is\s+defined|\bif\s+(not\s+)?thinking\b")


def detect(tokenizer, template: str) -> bool:
    return (CLOSE in template or OPEN in template) and has_token(tokenizer, CLOSE)


def build(tokenizer) -> ReasoningFormat:
    end_ids, forced_ids = budget_ids(tokenizer, CLOSE, after="\n\n")
    template = getattr(tokenizer, "chat_template", None)
    switched = isinstance(template, str) and THINKING_SWITCH.search(template) is not None
    thinks = (lambda kwargs: bool(kwargs.get("thinking"))) if switched else (lambda kwargs: True)
    return ReasoningFormat(NAME, end_ids, forced_ids, partial(splitter, (OPEN,), (CLOSE,)), thinks,
                           special_markers(tokenizer, (OPEN, CLOSE)))
