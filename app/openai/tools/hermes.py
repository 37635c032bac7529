"""Hermes style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more (Qwen2.5, Qwen3).

Arguments stream as the model writes them once the call has shown its name; a call in any other shape is parsed
whole when it closes. A bare JSON answer goes to the JSON parser; llama.cpp's `<function=name>{...}</function>`
is parsed at the end."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from app.openai.tools.base import (
    ToolCallDelta, ToolCallParser, call_from_json, find_outside_strings, new_call_id, value_end,
)
from app.openai.tools.json_calls import JsonToolParser, classify_start

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN = "<function="  # llama.cpp's lenient form: <function=name>{...}</function>
FUNCTION_RE = re.compile(r"<function=([^>\s]+)>\s*(.*?)\s*(?:</function>|$)", re.DOTALL)
# The fast path that streams arguments as they come: the call starts with its name, then "arguments".
HEAD_RE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass
class _Call:
    """One `<tool_call>` body as it arrives."""

    index: int
    tool_names: frozenset[str]
    body: str = ""
    id: str = field(default_factory=new_call_id)
    named: bool = False  # the first delta (id, name) is out
    args_start: int | None = None
    args_sent: int = 0  # characters of body[args_start:] already sent
    args_done: bool = False

    def feed(self, text: str) -> list[ToolCallDelta]:
        """Stream the name once known and argument text as it grows (only on the `{"name", "arguments": {` path)."""
        self.body += text
        out: list[ToolCallDelta] = []
        if not self.named:
            head = HEAD_RE.match(self.body)
            if head is None or head.end() >= len(self.body) or self.body[head.end()] != "{":
                return out  # not (yet) the streamable shape; close() parses the whole call
            name = json.loads(f'"{head.group(1)}"')
            if self.tool_names and name not in self.tool_names:
                return out
            self.named, self.args_start = True, head.end()
            out.append(ToolCallDelta(self.index, id=self.id, name=name))
        if not self.args_done:
            end = value_end(self.body, self.args_start)
            self.args_done = end is not None
            upto = end if end is not None else len(self.body)
            if upto > self.args_start + self.args_sent:
                out.append(ToolCallDelta(self.index, self.body[self.args_start + self.args_sent: upto]))
                self.args_sent = upto - self.args_start
        return out

    def close(self) -> list[ToolCallDelta] | None:
        """The call's text is over: whatever is left to send, or None if it is no call (then it is content)."""
        if self.named:  # name and arguments are out; only the wrapper's closing brace remained
            return []
        try:
            call = call_from_json(json.loads(self.body), self.tool_names)
        except ValueError:
            call = None
        if call is None:
            return None
        self.named = True
        return [ToolCallDelta(self.index, id=self.id, name=call[0]), ToolCallDelta(self.index, call[1])]


class HermesToolParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more; plus the coder-model habits."""

    def __init__(self, tool_names=(), parallel: bool = True):
        super().__init__(tool_names, parallel)
        self.state = "start"  # start -> text -> call -> between -> call ... | json (bare JSON habit) | function
        self.pending = ""  # text not yet shown or not yet understood
        self.call: _Call | None = None
        self.json_habit = JsonToolParser(tool_names, parallel)
        self.done = False  # parallel_tool_calls=false: the first call is complete, ignore the rest

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        if self.state == "json":
            return self.json_habit.feed(text)
        if self.state == "function" or self.done:
            self.pending += text
            return []
        self.pending += text
        if self.state == "start":
            kind = classify_start(self.pending)
            if kind is None:
                return []
            if kind == "json":
                self.state, text, self.pending = "json", self.pending, ""
                return self.json_habit.feed(text)
            self.state = "text"
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
                    self.state, self.pending = "function", self.pending[func:]
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
                self.state, rest, self.pending = "call", self.pending[at + len(OPEN):], ""
                out += self.call.feed(rest)
            else:  # "call": the body so far is in self.call.body
                if self.pending:
                    out += self.call.feed(self.pending)
                    self.pending = ""
                end = find_outside_strings(self.call.body, CLOSE)
                if end < 0:
                    return out
                after = self.call.body[end + len(CLOSE):]
                self.call.body = self.call.body[:end]
                out += self._close_call(complete=True)
                self.state, self.pending = "between", after
                if not self.parallel and self.call is None and self.calls:
                    self.done = True
                    return out

    def _close_call(self, complete: bool) -> list[str | ToolCallDelta]:
        call, self.call = self.call, None
        deltas = call.close()
        if deltas is not None:
            return deltas
        self.calls -= 1  # not a call after all: show it as the model wrote it, if nothing came before
        text = OPEN + call.body + (CLOSE if complete else "")
        return [text] if self.calls == 0 else []

    def finish(self) -> list[str | ToolCallDelta]:
        if self.state == "json":
            return self.json_habit.finish()
        if self.state == "function":
            calls = [(name, args) for name, args in FUNCTION_RE.findall(self.pending)]
            parsed = [call_from_json({"name": name, "arguments": json.loads(args) if _is_json(args) else None},
                                      self.tool_names) for name, args in calls]
            if parsed and all(parsed):
                return self._whole_calls(parsed)
            return [self.pending] if self.calls == 0 else []
        if self.state == "call":
            return self._close_call(complete=False)
        if self.state in ("start", "text") and self.pending:
            rest, self.pending = self.pending, ""
            return [rest]
        return []


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _tag_prefix_len(text: str) -> int:
    """Length of the longest tail of `text` that is the start of a tag we watch for."""
    for k in range(min(len(text), max(len(OPEN), len(FUNCTION_OPEN)) - 1), 0, -1):
        tail = text[-k:]
        if OPEN.startswith(tail) or FUNCTION_OPEN.startswith(tail):
            return k
    return 0
