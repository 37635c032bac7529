"""Bare JSON calls: the answer is `{"name", "arguments"}` (or a list of them), bare or in a ```json fence.

This is the format of templates that show tools but name no tag, and a habit of small coder models everywhere."""

from __future__ import annotations

import re

from app.openai.tools.base import ToolCallDelta, ToolCallParser, json_list_calls

FENCE_RE = re.compile(r"^```(?:json)?[ \t]*\n(.*?)\n?```\s*$", re.DOTALL)


def json_habit_calls(text: str, tool_names: frozenset[str]) -> list[tuple[str, str]] | None:
    """The whole answer as a bare JSON call, a list of calls, or either inside a ```json fence; else None."""
    text = text.strip()
    if fence := FENCE_RE.match(text):
        text = fence.group(1).strip()
    return json_list_calls(text, tool_names)


# A fence that has not shown its first value after this many characters is taken for text: the answer's start is
# then never rescanned for more than this (a model writing endless blank lines inside a fence costs nothing).
UNDECIDED_MAX = 256


def classify_start(text: str) -> str | None:
    """Could an answer starting like this be a bare JSON call? "json", "text", or None (too early to say)."""
    text = text.lstrip()
    if not text:
        return None
    if text[0] in "{[":
        return "json"
    if not "```".startswith(text[:3]):
        return "text"
    if len(text) > UNDECIDED_MAX:
        return "text"
    if len(text) < 3:
        return None
    info, newline, rest = text[3:].partition("\n")
    if not newline:
        return None if "json".startswith(info.strip()) else "text"
    if info.strip() not in ("", "json"):
        return "text"
    rest = rest.lstrip()
    return None if not rest else ("json" if rest[0] in "{[" else "text")


class StartOfAnswer:
    """The answer's first characters, gathered until `classify_start` can tell. Leading whitespace is set aside as
    it comes, so a model that writes many blank lines first is not rescanned for them on every token."""

    def __init__(self):
        self.blank: list[str] = []  # leading whitespace
        self.head = ""  # from the first other character on; at most about UNDECIDED_MAX before a decision

    def feed(self, text: str) -> str | None:
        if not self.head:
            stripped = text.lstrip()
            self.blank.append(text[: len(text) - len(stripped)])
            text = stripped
        self.head += text
        return classify_start(self.head)

    def text(self) -> str:
        return "".join(self.blank) + self.head


class JsonToolParser(ToolCallParser):
    """Templates that show tools but name no tag: a call is the whole answer as JSON (bare or fenced).

    Such an answer is held back until it ends, because only the whole text tells a call from a JSON answer."""

    def __init__(self, tool_names=(), parallel: bool = True, schemas=None):
        super().__init__(tool_names, parallel, schemas)
        self.start: StartOfAnswer | None = StartOfAnswer()
        self.held: list[str] = []  # a maybe-call, joined once at the end
        self.mode: str | None = None  # None: undecided, "text": plain content, "json": maybe a call

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        if self.mode == "text":
            return [text] if text else []
        if self.mode == "json":
            self.held.append(text)
            return []
        self.mode = self.start.feed(text)
        if self.mode is None:
            return []
        seen, self.start = self.start.text(), None
        if self.mode == "text":
            return [seen]
        self.held.append(seen)
        return []

    def finish(self) -> list[str | ToolCallDelta]:
        text = self.start.text() if self.start is not None else "".join(self.held)
        self.start, self.held = None, []
        calls = json_habit_calls(text, self.tool_names) if self.mode != "text" else None
        if calls:
            return self._whole_calls(calls)
        return [text] if text and self.mode != "text" else []
