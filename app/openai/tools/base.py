"""What every tool-call parser shares: the delta it emits, the base class, strict JSON decoding of the model's text
that cannot raise anything but ValueError, and an incremental string-aware tag search."""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(ID_CHARS) for _ in range(24))


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
            args = loads_model_json(args)
        except ValueError:
            return None
    if not isinstance(args, dict) or (tool_names and obj["name"] not in tool_names):
        return None
    try:
        return obj["name"], json.dumps(args, ensure_ascii=False)
    except RecursionError:  # nested deeper than the encoder's stack allows: not a call we can pass on
        return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Strict JSON: Python's decoder also reads NaN and Infinity, which no JSON client can.
DECODER = json.JSONDecoder(parse_constant=_no_constant)
WHITESPACE = re.compile(r"[ \t\n\r]*")  # JSON's four


def loads_model_json(text: str) -> Any:
    """json.loads for the model's text: any way it can fail is a ValueError, so one `except` covers it. (Nesting
    deeper than the decoder's stack raises RecursionError, which is no ValueError.)"""
    try:
        return DECODER.decode(text)
    except RecursionError as err:
        raise ValueError("JSON nested too deeply") from err


def object_members(text: str) -> dict[str, tuple[Any, str]]:
    """The members of the one JSON object that `text` is (whitespace aside): key -> (value, the value's own text).
    ValueError if `text` is anything else. Each value is decoded once, by json's C scanner: linear in the text."""
    def skip(i: int) -> int:
        return WHITESPACE.match(text, i).end()

    i = skip(0)
    if text[i:i + 1] != "{":
        raise ValueError("not a JSON object")
    members: dict[str, tuple[Any, str]] = {}
    i = skip(i + 1)
    if text[i:i + 1] == "}":
        i += 1
    else:
        while True:
            if text[i:i + 1] != '"':
                raise ValueError(f"expected a key at {i}")
            key, i = DECODER.raw_decode(text, i)
            i = skip(i)
            if text[i:i + 1] != ":":
                raise ValueError(f"expected ':' at {i}")
            start = skip(i + 1)
            try:
                value, end = DECODER.raw_decode(text, start)
            except RecursionError as err:
                raise ValueError("JSON nested too deeply") from err
            members[key] = (value, text[start:end])
            i = skip(end)
            if text[i:i + 1] == ",":
                i = skip(i + 1)
            elif text[i:i + 1] == "}":
                i += 1
                break
            else:
                raise ValueError(f"expected ',' or '}}' at {i}")
    if skip(i) != len(text):
        raise ValueError("extra data after the object")
    return members


class TagOutsideStrings:
    """Finds `tag` outside JSON strings in text that arrives piece by piece. The state (inside a string, after a
    backslash, how much of the tag is matched) carries over between pieces, so each character is looked at once
    however the text is split: a call's body is never rescanned (an earlier parser rescanned it on every token)."""

    def __init__(self, tag: str):
        self.tag = tag
        self.in_string = self.escaped = False
        self.matched = 0  # characters of the tag matched at the end of what was fed

    def feed(self, text: str) -> int:
        """The offset in `text` just past the tag, or -1 if it has not appeared yet."""
        tag, last = self.tag, len(self.tag) - 1
        in_string, escaped, matched = self.in_string, self.escaped, self.matched
        found = -1
        for i, ch in enumerate(text):
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == tag[matched]:
                if matched == last:
                    found, matched = i + 1, 0
                    break
                matched += 1
            else:  # the tag's first character appears nowhere else in it, so a mismatch restarts from scratch
                matched = 1 if ch == tag[0] else 0
                in_string = ch == '"'
        self.in_string, self.escaped, self.matched = in_string, escaped, matched
        return found


class ToolCallParser:
    """Base: feed text deltas, get content strings and ToolCallDeltas; `finish()` at the end of the answer."""

    def __init__(self, tool_names: list[str] | frozenset[str] = (), parallel: bool = True,
                 schemas: dict[str, Any] | None = None):
        self.tool_names = frozenset(tool_names)
        self.parallel = parallel
        self.schemas = schemas or {}  # tool name -> its `parameters` schema (formats whose values are untyped text)
        self.calls = 0  # calls started so far

    def new_id(self) -> str:
        return new_call_id()

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        raise NotImplementedError

    def finish(self) -> list[str | ToolCallDelta]:
        raise NotImplementedError

    def _whole_calls(self, calls: list[tuple[str, str]]) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        for name, arguments in calls[: None if self.parallel else 1]:
            call_id = self.new_id()
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


def json_list_calls(text: str, tool_names: frozenset[str]) -> list[tuple[str, str]] | None:
    """A JSON list of {"name", "arguments" (or "parameters")} objects, or one such object, if every one is a call
    of an offered tool; else None (Mistral's, Granite's and Phi-4-mini's lists)."""
    try:
        obj = loads_model_json(text)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [call_from_json(item, tool_names) for item in items]
    return calls if calls and all(calls) else None


def named_call(name: str, arguments: str, tool_names: frozenset[str]) -> tuple[str, str] | None:
    """A call written as a name and a JSON object apart (Mistral's `name[ARGS]{...}`, DeepSeek's, harmony's):
    (name, the arguments as the model wrote them), or None unless the name is offered and the arguments an
    object."""
    name, arguments = name.strip(), arguments.strip() or "{}"
    if not name or any(ch.isspace() for ch in name) or (tool_names and name not in tool_names):
        return None
    try:
        args = loads_model_json(arguments)
    except ValueError:
        return None
    return (name, arguments) if isinstance(args, dict) else None
