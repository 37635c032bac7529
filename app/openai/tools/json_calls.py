"""Bare JSON calls: the answer is `{"name", "arguments"}` (or a list of them), bare or in a ```json fence.

This is the format of templates that show tools but name no tag, and a habit of small coder models everywhere."""

from __future__ import annotations

import json
import re

from app.openai.tools.base import ToolCallDelta, ToolCallParser, call_from_json

FENCE_RE = re.compile(r"^```(?:json)?[ \t]*\n(.*?)\n?```\s*$", re.DOTALL)


def json_habit_calls(text: str, tool_names: frozenset[str]) -> list[tuple[str, str]] | None:
    """The whole answer as a bare JSON call, a list of calls, or either inside a ```json fence; else None."""
    text = text.strip()
    if fence := FENCE_RE.match(text):
        text = fence.group(1).strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [call_from_json(item, tool_names) for item in items]
    return calls if calls and all(calls) else None


def classify_start(text: str) -> str | None:
    """Could an answer starting like this be a bare JSON call? "json", "text", or None (too early to say)."""
    text = text.lstrip()
    if not text:
        return None
    if text[0] in "{[":
        return "json"
    if "```".startswith(text[:3]):
        if len(text) < 3 or "\n" not in text:
            return None
        info, _, rest = text[3:].partition("\n")
        if info.strip() not in ("", "json"):
            return "text"
        rest = rest.lstrip()
        return None if not rest else ("json" if rest[0] in "{[" else "text")
    return "text"


class JsonToolParser(ToolCallParser):
    """Templates that show tools but name no tag: a call is the whole answer as JSON (bare or fenced).

    Such an answer is held back until it ends, because only the whole text tells a call from a JSON answer."""

    def __init__(self, tool_names=(), parallel: bool = True):
        super().__init__(tool_names, parallel)
        self.buffer = ""
        self.mode: str | None = None  # None: undecided, "text": plain content, "json": maybe a call

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        if self.mode == "text":
            return [text] if text else []
        self.buffer += text
        self.mode = classify_start(self.buffer)
        if self.mode == "text":
            out, self.buffer = self.buffer, ""
            return [out]
        return []

    def finish(self) -> list[str | ToolCallDelta]:
        text, self.buffer = self.buffer, ""
        calls = json_habit_calls(text, self.tool_names) if self.mode != "text" else None
        if calls:
            return self._whole_calls(calls)
        return [text] if text else []
