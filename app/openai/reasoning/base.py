"""What every reasoning format shares: the format's description, the splitter's interface, the budget.

A `ReasoningFormat` is made once per served model (app/openai/reasoning/__init__.py picks it): the ids that end the
thinking and the ids the engine forces when the budget runs out (app/core/preamble.py), whether a request thinks
(each family has its own template switch), and a fresh `ReasoningSplitter` per answer.

A splitter works on text, as the client sees it. Some families mark their thinking with special tokens (gpt-oss's
`<|channel|>`, Magistral's `[THINK]`), which decoding skips (app/core/detokenize.py decodes with
`skip_special_tokens`), so the splitter is also told each token's id and puts such a marker's text back itself
(`markers`: special id -> its text). A marker that is an ordinary token (Qwen3's `<think>`) is already in the text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from app.core.preamble import Preamble
from app.errors import InvalidRequest

# Budgets for OpenAI's `reasoning_effort`, in generated tokens of thinking. Qwen3's own advice is to leave room
# for long thoughts (it suggests 32k output tokens); these are caps for callers who want answers sooner.
EFFORT_BUDGETS = {"minimal": 0, "low": 512, "medium": 2048, "high": 8192}
# `reasoning_effort` as a template reads it (gpt-oss's knows low, medium and high)
TEMPLATE_EFFORT = {"minimal": "low"}


class ReasoningSplitter:
    """Text deltas in, (reasoning, content) deltas out; `flush()` once the answer has ended.

    The streamed deltas always join up to what one feed of the whole text gives, because a tail that could still be
    the start of a marker is held back until the next delta says what it is. `state` is "content" once the answer
    proper has begun (the tokens before it are counted as reasoning tokens)."""

    state = "content"

    def __init__(self, markers: dict[int, str] | None = None):
        self.markers = markers or {}

    def feed(self, text: str, token_id: int | None = None) -> tuple[str, str]:
        marker = self.markers.get(token_id) if token_id is not None else None
        return self.split(marker + text if marker else text)

    def split(self, text: str) -> tuple[str, str]:
        return "", text

    def flush(self) -> tuple[str, str]:
        return "", ""


@dataclass(frozen=True)
class ReasoningFormat:
    """How one model family marks its thinking, for the engine's budget (ids) and the splitter (text)."""

    name: str
    end_ids: tuple[int, ...]  # what ends the thinking, e.g. "</think>"
    forced_end_ids: tuple[int, ...]  # what the engine writes when the budget runs out: "</think>\n\n"
    make_splitter: Callable[[bool, dict[int, str]], ReasoningSplitter]  # (thinking, markers) -> a fresh splitter
    thinks: Callable[[dict], bool] = lambda template_kwargs: True  # does a request with these switches think?
    markers: dict[int, str] = field(default_factory=dict)
    # gpt-oss: `reasoning_effort` is the template's own switch ("Reasoning: low"), so it sets no token budget
    effort_in_template: bool = False

    def splitter(self, thinking: bool) -> ReasoningSplitter:
        return self.make_splitter(thinking, self.markers)

    def preamble(self, budget: int | None) -> Preamble:
        return Preamble(end_ids=self.end_ids, budget=budget, forced_ids=self.forced_end_ids)

    def budget(self, max_reasoning_tokens: int | None, effort: str | None) -> int | None:
        budget = reasoning_budget(max_reasoning_tokens, effort)  # checks both fields, whatever the format
        if self.effort_in_template and max_reasoning_tokens is None and effort != "minimal":
            return None
        return budget


def reasoning_budget(max_reasoning_tokens: int | None, effort: str | None) -> int | None:
    """`max_reasoning_tokens` wins; else `reasoning_effort` maps to a budget; neither: no budget."""
    if max_reasoning_tokens is not None:
        if max_reasoning_tokens < 0:
            raise InvalidRequest("max_reasoning_tokens must be >= 0", param="max_reasoning_tokens")
        return max_reasoning_tokens
    if effort is None:
        return None
    if effort not in EFFORT_BUDGETS:
        raise InvalidRequest(f"reasoning_effort must be one of none, {', '.join(EFFORT_BUDGETS)}, got {effort!r}",
                             param="reasoning_effort")
    return EFFORT_BUDGETS[effort]


def encode(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def budget_ids(tokenizer, end: str, before: str = "", after: str = "") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(end_ids, forced_ids): the forced text is encoded in pieces around the end marker, so that it contains
    `end_ids` exactly whatever the tokenizer merges (app/core/preamble.py requires it)."""
    end_ids = encode(tokenizer, end)
    forced = (encode(tokenizer, before) if before else ()) + end_ids + (encode(tokenizer, after) if after else ())
    return end_ids, forced


def special_markers(tokenizer, texts: tuple[str, ...]) -> dict[int, str]:
    """The markers among `texts` that are one token each and that decoding drops (special tokens): the splitter
    restores those. Asked of decode itself, since a token flagged special in tokenizer.json need not be among
    `all_special_ids`."""
    out = {}
    for text in texts:
        ids = encode(tokenizer, text)
        if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == "":
            out[ids[0]] = text
    return out


def has_token(tokenizer, text: str) -> bool:
    token_id = tokenizer.convert_tokens_to_ids(text)
    return token_id is not None and token_id != tokenizer.unk_token_id


def partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is the start of a marker (held back: it may become one)."""
    longest = max((len(m) for m in markers), default=1)
    for k in range(min(len(text), longest - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


def first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """(where, which) of the earliest marker in `text`, or None."""
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found, key=lambda f: (f[0], -len(f[1]))) if found else None
