"""Reasoning models: split an answer into its thinking and its content, one module per family's format.

Clients expect the two apart: the thinking as `reasoning_content` (and, under vLLM's newer name, `reasoning`) in chat
completions, as a `reasoning` item in the Responses API and as `thinking` blocks in Anthropic's Messages API; the
answer as content, with no marker in either. Each family marks its thinking its own way, as vLLM's reasoning
parsers read them (`--reasoning-parser`):
  * "deepseek_r1": `<think>` opened by the template, the answer starts inside the thinking (deepseek_r1.py);
  * "qwen3":       `<think>…</think>`, switched by the template's `enable_thinking` (qwen3.py);
  * "harmony":     gpt-oss's `analysis` channel before its `final` one; `reasoning_effort` reaches the template
                   (harmony.py);
  * "magistral":   Mistral Magistral's `[THINK]…[/THINK]` (magistral.py);
  * "granite":     Granite 3.2's "Here is my thought process:" … "Here is my response:" (granite.py).

`REASONING_PARSER=auto` (the default) picks the format from the chat template and the tokenizer's special tokens,
in the order of `PARSERS` (the first whose `detect` holds); a name forces one, `none` serves every answer as plain
content. Only for a model that thinks do responses carry reasoning fields, and only then do the reasoning budget
fields (`max_reasoning_tokens`, `reasoning_effort`) apply.

One splitter serves both streaming and whole answers (a whole answer is one stream, flushed), so the streamed
deltas always join up to the non-streamed fields, and a marker split over tokens never shows.
"""

from __future__ import annotations

from app.openai.reasoning import deepseek_r1, granite, harmony, magistral, qwen3
from app.openai.reasoning.base import (EFFORT_BUDGETS, TEMPLATE_EFFORT, ReasoningFormat, ReasoningSplitter,
                                       reasoning_budget)

__all__ = ["EFFORT_BUDGETS", "PARSERS", "TEMPLATE_EFFORT", "ReasoningFormat", "ReasoningSplitter", "check_parser_name",
           "reasoning_budget", "reasoning_format"]

# Auto-detection tries these in order: qwen3 before deepseek_r1 (both have `</think>`; only Qwen3's template reads
# `enable_thinking`).
PARSERS = {module.NAME: module for module in (harmony, magistral, granite, qwen3, deepseek_r1)}


def check_parser_name(name: str) -> str:
    """REASONING_PARSER's value, or a ValueError listing the names there are (refused at start)."""
    if name not in ("auto", "none", *PARSERS):
        raise ValueError(f"unknown reasoning parser {name!r}; the names are auto, none, {', '.join(sorted(PARSERS))}")
    return name


def reasoning_format(tokenizer, parser: str = "auto") -> ReasoningFormat | None:
    """How the model marks its thinking, or None when it does not think (or `parser` is "none")."""
    check_parser_name(parser)
    if parser == "none":
        return None
    if parser != "auto":
        return PARSERS[parser].build(tokenizer)
    template = _template_text(getattr(tokenizer, "chat_template", None))
    for module in PARSERS.values():
        if template and module.detect(tokenizer, template):
            return module.build(tokenizer)
    return None


def _template_text(template) -> str:
    """All of a model's template text; named templates (a dict) are searched together."""
    if isinstance(template, dict):
        return "\n".join(t for t in template.values() if isinstance(t, str))
    return template if isinstance(template, str) else ""
