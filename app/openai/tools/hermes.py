"""Hermes style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more (Qwen2.5, Qwen3).

A call is held back until its closing tag (or the end of the answer), then parsed once: only a body that is one
JSON object naming an offered tool, with an object for arguments, goes out as a call; anything else is the model's
text and stays content, streamed or not. Nothing of a call is sent before it is known good, because a streamed call
cannot be taken back (the package's docstring says why this and not vLLM's way). The closing tag is found by a
scan that knows JSON strings and keeps its state between tokens, so each character is scanned once. A bare JSON
answer goes to the JSON parser; llama.cpp's `<function=name>{...}</function>` is parsed at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.openai.tools.base import (
    TagOutsideStrings, ToolCallDelta, ToolCallParser, call_from_json, loads_model_json, new_call_id, object_members,
)
from app.openai.tools.json_calls import JsonToolParser, StartOfAnswer

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"  # llama.cpp's lenient form: <function=name>{...}</function>


@dataclass
class _Call:
    """One `<tool_call>` body as it arrives: kept in pieces (joined once, at the end) while the tag is looked for."""

    index: int
    tool_names: frozenset[str]
    pieces: list[str] = field(default_factory=list)
    end_tag: TagOutsideStrings = field(default_factory=lambda: TagOutsideStrings(CLOSE))
    body: str = ""  # the whole body, once it has ended

    def feed(self, text: str) -> int:
        """Take the next piece of the body; the offset in `text` just past the closing tag, or -1 if not there yet."""
        end = self.end_tag.feed(text)
        self.pieces.append(text if end < 0 else text[:end])
        if end >= 0:
            self.body = "".join(self.pieces)[: -len(CLOSE)]
        return end

    def close(self, complete: bool) -> list[ToolCallDelta] | None:
        """The call's text is over: its two deltas (id and name, then the arguments), or None if it is no call."""
        if not complete:
            self.body = "".join(self.pieces)
        call = parse_body(self.body, self.tool_names)
        if call is None:
            return None
        call_id = new_call_id()
        return [ToolCallDelta(self.index, id=call_id, name=call[0]), ToolCallDelta(self.index, call[1])]


def parse_body(body: str, tool_names: frozenset[str]) -> tuple[str, str] | None:
    """A call's body -> (name, arguments as the model wrote them), or None unless it is one JSON object with a
    string name (an offered tool's, when tools are named) and an object for arguments (or a string holding one)."""
    try:
        members = object_members(body)
    except ValueError:
        return None
    name = members.get("name", (None, ""))[0]
    args, raw = members.get("arguments") or members.get("parameters") or ({}, "{}")
    if isinstance(args, str):  # some models encode the arguments object as a string
        try:
            args, raw = loads_model_json(args), args.strip()
        except ValueError:
            return None
    if not isinstance(name, str) or not isinstance(args, dict) or (tool_names and name not in tool_names):
        return None
    return name, raw


class HermesToolParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more; plus the coder-model habits."""

    def __init__(self, tool_names=(), parallel: bool = True, schemas=None):
        super().__init__(tool_names, parallel, schemas)
        self.state = "start"  # start -> text -> call -> between -> call ... | json (bare JSON habit) | function
        self.start: StartOfAnswer | None = StartOfAnswer()
        self.pending = ""  # text not yet shown: a tail that could still become a tag (a few characters at most)
        self.held: list[str] = []  # "function": the rest of the answer, parsed at the end
        self.call: _Call | None = None
        self.json_habit = JsonToolParser(tool_names, parallel)
        self.done = False  # parallel_tool_calls=false: the first call is complete, ignore the rest

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        if self.state == "json":
            return self.json_habit.feed(text)
        if self.done:  # parallel_tool_calls=false and the call is out: the rest is neither shown nor kept
            return []
        if self.state == "function":
            self.held.append(text)
            return []
        if self.state == "start":
            kind = self.start.feed(text)
            if kind is None:
                return []
            text, self.start = self.start.text(), None
            if kind == "json":
                self.state = "json"
                return self.json_habit.feed(text)
            self.state = "text"
        self.pending += text
        return self._advance()

    def _advance(self) -> list[str | ToolCallDelta]:
        out: list[str | ToolCallDelta] = []
        while True:
            if self.state in ("text", "between"):
                at = self.pending.find(OPEN)
                func = self.pending.find(FUNCTION_OPEN) if self.calls == 0 else -1
                if func >= 0 and (at < 0 or func < at):
                    if self.state == "text" and func > 0:
                        out.append(self.pending[:func])
                    self.state, self.held, self.pending = "function", [self.pending[func:]], ""
                    return out
                if at < 0:  # hold back a tail that could still grow into a tag
                    hold = _tag_prefix_len(self.pending)
                    shown, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold:]
                    if self.state == "text" and shown:
                        out.append(shown)
                    return out
                if self.state == "text" and at > 0:
                    out.append(self.pending[:at])
                self.call = _Call(self.calls, self.tool_names)
                self.calls += 1
                self.state, self.pending = "call", self.pending[at + len(OPEN):]
            else:  # "call": each new character goes to the call's tag search once, never rescanned
                end = self.call.feed(self.pending)
                if end < 0:
                    self.pending = ""
                    return out
                after, self.pending = self.pending[end:], ""
                out += self._close_call(complete=True)
                self.state, self.pending = ("between" if self.calls else "text"), after
                if not self.parallel and self.calls:
                    self.done = True
                    return out

    def _close_call(self, complete: bool) -> list[str | ToolCallDelta]:
        call, self.call = self.call, None
        deltas = call.close(complete)
        if deltas is not None:
            return deltas
        self.calls -= 1  # not a call after all: show it as the model wrote it, if nothing came before
        text = OPEN + call.body + (CLOSE if complete else "")
        return [text] if self.calls == 0 else []

    def finish(self) -> list[str | ToolCallDelta]:
        if self.state == "json":
            return self.json_habit.finish()
        if self.state == "start":
            rest, self.start = self.start.text(), None
            return [rest] if rest else []
        if self.state == "function":
            text, self.held = "".join(self.held), []
            calls = function_calls(text, self.tool_names)
            if calls:
                return self._whole_calls(calls)
            return [text] if self.calls == 0 else []
        if self.state == "call":
            return self._close_call(complete=False)
        if self.state == "text" and self.pending:
            rest, self.pending = self.pending, ""
            return [rest]
        return []


def function_calls(text: str, tool_names: frozenset[str]) -> list[tuple[str, str]] | None:
    """llama.cpp's `<function=name>{...}</function>` calls (the last one may lack its closing tag), if every one
    names an offered tool with an object for arguments; else None. Split by the tags, not matched by a regex: a
    lazy match before optional whitespace backtracks over long runs of blanks."""
    calls = []
    for part in text.split(FUNCTION_OPEN)[1:]:
        name, bracket, rest = part.partition(">")
        if not bracket or not name or any(ch.isspace() for ch in name):
            return None
        args = rest.split(FUNCTION_CLOSE, 1)[0]
        try:
            call = call_from_json({"name": name, "arguments": loads_model_json(args)}, tool_names)
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _tag_prefix_len(text: str) -> int:
    """Length of the longest tail of `text` that is the start of a tag we watch for."""
    for k in range(min(len(text), max(len(OPEN), len(FUNCTION_OPEN)) - 1), 0, -1):
        tail = text[-k:]
        if OPEN.startswith(tail) or FUNCTION_OPEN.startswith(tail):
            return k
    return 0
