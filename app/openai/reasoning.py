"""Reasoning models (Qwen3): split the answer into its thinking and its content.

Qwen3 thinks first, inside `<think>…</think>`, then answers. Clients expect the two apart: the thinking as
`reasoning_content` (and, under vLLM's newer name, `reasoning`), the answer as `content`, with the tags in neither.
The semantics are those of vLLM's qwen3 reasoning parser:
- with thinking on, a generated `<think>` is dropped and the text up to `</think>` is reasoning; if `</think>` never
  comes (max_tokens cut the thinking short), all of it is reasoning;
- with thinking off (`chat_template_kwargs: {"enable_thinking": false}`, the template then writes an empty think
  block into the prompt), everything is content.
Like llama.cpp, we also trim the newlines Qwen3 puts around the thinking (`<think>\\n…\\n</think>\\n\\n`).

One `ReasoningSplitter` serves both streaming and whole answers (a whole answer is one stream, flushed), so the
streamed deltas always join up to the non-streamed fields. It works on text, holding back any tail that could be
the start of a tag, so the tags never show even when a tokenizer splits them.

`reasoning_format` says whether a model thinks at all; only then do responses carry reasoning fields, and only then
do the reasoning budget fields (`max_reasoning_tokens`, `reasoning_effort`) apply.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.core.preamble import Preamble
from app.errors import InvalidRequest

THINK_START, THINK_END = "<think>", "</think>"
# Budgets for OpenAI's `reasoning_effort`, in generated tokens of thinking. Qwen3's own advice is to leave room
# for long thoughts (it suggests 32k output tokens); these are caps for callers who want answers sooner.
EFFORT_BUDGETS = {"minimal": 0, "low": 512, "medium": 2048, "high": 8192}


@dataclass(frozen=True)
class ReasoningFormat:
    """How one model marks its thinking, as token ids (for the engine's budget) and text (for the splitter)."""

    end_ids: tuple[int, ...]  # "</think>"
    forced_end_ids: tuple[int, ...]  # what closes the thinking when the budget runs out: "</think>\n\n"

    def preamble(self, budget: int | None) -> Preamble:
        return Preamble(end_ids=self.end_ids, budget=budget, forced_ids=self.forced_end_ids)


def reasoning_format(tokenizer) -> ReasoningFormat | None:
    """A model thinks when its chat template writes think blocks and its vocabulary has `</think>` as one token
    (Qwen3, QwQ, DeepSeek-R1 distills). Qwen2.5 has neither."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str) or THINK_END not in template:
        return None
    end_id = tokenizer.convert_tokens_to_ids(THINK_END)
    if end_id is None or end_id == tokenizer.unk_token_id:
        return None
    # Qwen3's template closes a thought with "</think>\n\n" before the answer; force exactly what it would write.
    forced = tuple(tokenizer.encode(THINK_END + "\n\n", add_special_tokens=False))
    return ReasoningFormat(end_ids=(end_id,), forced_end_ids=forced)


def reasoning_budget(max_reasoning_tokens: int | None, effort: str | None) -> int | None:
    """`max_reasoning_tokens` wins; else `reasoning_effort` maps to a budget; neither: no budget."""
    if max_reasoning_tokens is not None:
        if max_reasoning_tokens < 0:
            raise InvalidRequest("max_reasoning_tokens must be >= 0", param="max_reasoning_tokens")
        return max_reasoning_tokens
    if effort is None:
        return None
    if effort not in EFFORT_BUDGETS:
        raise InvalidRequest(f"reasoning_effort must be one of {', '.join(EFFORT_BUDGETS)}, got {effort!r}",
                             param="reasoning_effort")
    return EFFORT_BUDGETS[effort]


class ReasoningSplitter:
    """Text deltas in, (reasoning, content) deltas out."""

    def __init__(self, thinking: bool):
        # "start": before the thinking (a generated <think> may come); "reasoning"; "content"
        self.state = "start" if thinking else "content"
        self.trim_content = False  # drop the newlines between </think> and the answer
        self.reasoning_shown = False  # leading newlines of the thinking are dropped
        self.pending = ""  # held back: a possible tag start, or whitespace that may turn out to be trailing

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning = content = ""
        if self.state == "start":
            head = self.pending.lstrip()
            if THINK_START.startswith(head):  # nothing yet, or the start of the tag: wait for more
                return "", ""
            self.pending = head[len(THINK_START):] if head.startswith(THINK_START) else head
            self.state = "reasoning"
        if self.state == "reasoning":
            before, found, after = self.pending.partition(THINK_END)
            if found:
                reasoning = self._reasoning(before.rstrip())
                self.pending, self.state, self.trim_content = after, "content", True
            else:
                keep = _tail_to_hold(before)
                reasoning = self._reasoning(before[: len(before) - keep])
                self.pending = before[len(before) - keep:]
        if self.state == "content":
            if self.trim_content:
                self.pending = self.pending.lstrip()
                self.trim_content = not self.pending
            content, self.pending = self.pending, ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """The answer ended: what is held is real text, except a thinking's trailing whitespace."""
        rest, self.pending = self.pending, ""
        if self.state == "content":
            return "", rest
        if self.state == "start":  # only whitespace or a bare "<think" came: nothing worth showing
            rest = rest.strip()
            return ("", "") if THINK_START.startswith(rest) else (self._reasoning(rest), "")
        return self._reasoning(rest.rstrip()), ""

    def _reasoning(self, text: str) -> str:
        if not self.reasoning_shown:
            text = text.lstrip()
            self.reasoning_shown = bool(text)
        return text


def _tail_to_hold(text: str) -> int:
    """How much of the end of `text` might still be trailing whitespace before `</think>`, or the tag's start."""
    for k in range(min(len(text), len(THINK_END) - 1), 0, -1):
        if THINK_END.startswith(text[-k:]):
            text = text[:-k]
            return k + len(text) - len(text.rstrip())
    return len(text) - len(text.rstrip())
