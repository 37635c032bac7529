"""IBM Granite 3.2's thinking mode: "Here is my thought process:" … "Here is my response:" in plain text.

The template asks for it only when a request sets `chat_template_kwargs: {"thinking": true}`; otherwise the answer
is all content. As vLLM's granite parser, both phrases are also accepted as "Here's …" (seen from quantized
Granites). An answer that does not start with the thought phrase is all content; one cut off before the response
phrase is all reasoning. The phrases are ordinary text, split over several tokens, so the splitter holds back any
tail that could still become one. Picked when the template contains the thought phrase.
"""

from __future__ import annotations

from functools import partial

from app.openai.reasoning.base import ReasoningFormat, budget_ids
from app.openai.reasoning.magistral import splitter

NAME = "granite"
OPENS = ("Here is my thought process:", "Here's my thought process:")
CLOSES = ("Here is my response:", "Here's my response:")


def detect(tokenizer, template: str) -> bool:
    return any(phrase in template for phrase in OPENS)


def thinks(template_kwargs: dict) -> bool:
    return bool(template_kwargs.get("thinking"))


def build(tokenizer) -> ReasoningFormat:
    # The end is matched on " my response:" so that "Here's my response:" ends the thinking for the budget too;
    # a byte-level BPE splits words and ":" apart, so these ids are the same wherever the phrase stands.
    end_ids, forced_ids = budget_ids(tokenizer, " my response:", before="\n\nHere is", after="\n")
    return ReasoningFormat(NAME, end_ids, forced_ids, partial(splitter, OPENS, CLOSES), thinks)
