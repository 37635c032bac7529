"""Tool calls in the model's text -> OpenAI `tool_calls`, one parser per output format, streamed or not.

Which parser runs is read from the chat template (`tool_format`):
  * "hermes": the template asks for `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Qwen2.5, Qwen3);
  * "json":   the template renders `tools` but names no tag: the answer is a bare JSON call;
  * None:     the template cannot show tools at all, so a request with tools gets a 400 (never silently dropped).

Both parsers also accept the habits of small coder models that ignore the tag when tools were offered (Ollama
13519, vLLM 21571): the whole answer as a bare JSON object (or a list of them) with name and arguments, or the same
inside a ```json fence; Hermes also takes llama.cpp's `<function=name>{...}</function>`.

A parser is fed text deltas and returns what may be shown: `str` for content, `ToolCallDelta` for calls. The
non-streamed answer runs the very same parser over the whole text (`parse_tool_calls`), so a streamed answer always
equals the non-streamed one. As with stop strings, a tail that could still become a tag is held back, so neither
the tag nor its start ever reaches content. Content is the text before the first call; text between or after calls
is dropped (as vLLM does).

A call is a call only if its JSON is valid (strict: no trailing commas, single quotes, True, NaN) and its arguments
are an object; otherwise the model's text stays content, streamed or not, and finish_reason stays "stop". So a
call is held back until it is complete and checked, then sent whole: the first delta carries id and name, the
second all the arguments. Peers stream arguments as they come and cannot take back a call that turns out broken:
vLLM's Hermes parser then sends whatever it had (vLLM 21544, 10395); llama.cpp constrains a Hermes call with a
lazy grammar from `<tool_call>` on, so its calls are well-formed, and makes a call that fails the final parse
content. We constrain only forced calls, so we hold back instead. Holding back costs a client the live view of a long call's arguments; it never changes what the
client ends up with, and a call is only actionable once complete anyway. Arguments are the model's own text for
the arguments object (so `{}` stays `{}`, vLLM 28806, and 1.10 stays 1.10). The end of a call is found by a scan
that knows JSON strings, so a literal `</tool_call>` inside an argument string does not end it (vLLM 45167); that
scan keeps its state between tokens, so parsing is linear in the answer (`python -m benchmarks tools`). Nothing in
the model's text can make a parser raise: every decode of it is guarded, deep nesting included.
"""

from __future__ import annotations

import re

from app.openai.tools.base import ParsedAnswer, ToolCallDelta, ToolCallParser, collect, new_call_id
from app.openai.tools.hermes import OPEN, HermesToolParser
from app.openai.tools.json_calls import JsonToolParser, classify_start, json_habit_calls

__all__ = ["ParsedAnswer", "ToolCallDelta", "ToolCallParser", "HermesToolParser", "JsonToolParser", "classify_start",
           "collect", "json_habit_calls", "make_parser", "new_call_id", "parse_tool_calls", "tool_format"]


def tool_format(chat_template: str | dict | None) -> str | None:
    """The tool-call format a chat template asks for: "hermes", "json", or None when it cannot render tools."""
    if isinstance(chat_template, dict):  # named templates: transformers picks "tool_use" when tools are given
        chat_template = chat_template.get("tool_use") or chat_template.get("default")
    if not chat_template or not re.search(r"\btools\b", chat_template):
        return None
    return "hermes" if OPEN in chat_template else "json"


PARSERS = {"hermes": HermesToolParser, "json": JsonToolParser}


def make_parser(fmt: str, tool_names, parallel: bool = True) -> ToolCallParser:
    return PARSERS[fmt](tool_names, parallel)


def parse_tool_calls(text: str, fmt: str, tool_names=(), parallel: bool = True) -> ParsedAnswer:
    """The non-streamed answer: the streaming parser over the whole text at once."""
    parser = make_parser(fmt, tool_names, parallel)
    return collect(parser.feed(text) + parser.finish())
