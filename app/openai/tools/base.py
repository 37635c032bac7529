"""What every tool-call parser shares: the delta it emits, the base class, and string-aware JSON scanning."""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Any, Iterator

_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass
class ToolCallDelta:
    """One streamed piece of call `index`: the first carries id and name, later ones argument fragments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def wire(self) -> dict[str, Any]:
        if self.id is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


def call_from_json(obj: Any, tool_names: frozenset[str]) -> tuple[str, str] | None:
    """{"name", "arguments" (or "parameters")} -> (name, arguments JSON), if it names an offered tool."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models encode the arguments object as a string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict) or (tool_names and obj["name"] not in tool_names):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)




def outside_strings(text: str, start: int = 0) -> Iterator[tuple[int, str]]:
    """Each (index, character) of text[start:] that is neither inside a JSON string nor one of its quotes."""
    in_string, escaped = False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        else:
            yield i, ch


def value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array starting at text[start] ends (exclusive), or None if it is not complete yet."""
    depth = 0
    for i, ch in outside_strings(text, start):
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def find_outside_strings(text: str, needle: str) -> int:
    """The first `needle` in `text` that is not inside a JSON string, or -1."""
    return next((i for i, _ in outside_strings(text) if text.startswith(needle, i)), -1)


class ToolCallParser:
    """Base: feed text deltas, get content strings and ToolCallDeltas; `finish()` at the end of the answer."""

    def __init__(self, tool_names: list[str] | frozenset[str] = (), parallel: bool = True):
        self.tool_names = frozenset(tool_names)
        self.parallel = parallel
        self.calls = 0  # calls started so far

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        raise NotImplementedError

    def finish(self) -> list[str | ToolCallDelta]:
        raise NotImplementedError

    def _whole_calls(self, calls: list[tuple[str, str]]) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        for name, arguments in calls[: None if self.parallel else 1]:
            call_id = new_call_id()
            out += [ToolCallDelta(self.calls, id=call_id, name=name), ToolCallDelta(self.calls, arguments)]
            self.calls += 1
        return out


@dataclass
class ParsedAnswer:
    content: str | None
    tool_calls: list[dict[str, Any]]


def collect(items: list[str | ToolCallDelta]) -> ParsedAnswer:
    """Join parser output into a message: content before the first call (None if blank), and whole calls."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for item in items:
        if isinstance(item, str):
            content.append(item)
        elif item.id is not None:
            calls[item.index] = {"id": item.id, "type": "function",
                                 "function": {"name": item.name, "arguments": item.arguments}}
        else:
            calls[item.index]["function"]["arguments"] += item.arguments
    text = "".join(content)
    return ParsedAnswer(text if text.strip() else None, [calls[i] for i in sorted(calls)])
