"""Tool calls in the model's text -> OpenAI `tool_calls`, one parser per output format, streamed or not.

Which parser runs is TOOL_CALL_PARSER's (a name of PARSERS), or with `auto` read from the chat template and the
tokenizer's special tokens (`tool_format`, first match in this order):
  * "harmony":     gpt-oss (`<|channel|>`, `to=functions.NAME`), harmony.py;
  * "deepseek_v3": DeepSeek-V3 / R1 / V3.1 (`<｜tool▁calls▁begin｜>`), deepseek.py;
  * "qwen3_coder": Qwen3-Coder (`<function=...>` with `<parameter=...>`), qwen3_coder.py;
  * "mistral":     `[TOOL_CALLS]` (or `[AVAILABLE_TOOLS]`), mistral.py;
  * "phi4_mini":   `<|/tool_call|>` or Phi's `<|tool|>` tools block, granite.py;
  * "granite":     `<|tool_call|>` or Granite's `<|start_of_role|>` roles, granite.py;
  * "hermes":      `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Qwen2.5, Qwen3), hermes.py;
  * "pythonic":    a template that asks for `[func_name1(params_name1=...)]` or has `<|python_start|>` (Llama 4);
  * "llama3_json": `<|python_tag|>` or Llama 3's `ipython` role, llama.py;
  * "json":        the template renders `tools` but names no tag: the answer is a bare JSON call;
  * None:          the template cannot show tools at all, so a request with tools gets a 400 (never silently dropped).
The formats and their markers are in docs/tools-and-structured-outputs.md; sections.py is the streaming machine
every marker-based format shares.

Hermes and JSON also accept the habits of small coder models that ignore the tag when tools were offered (Ollama
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
the arguments object (so `{}` stays `{}`, vLLM 28806, and 1.10 stays 1.10) in the formats that write them as one
JSON object (Hermes, Mistral's `[ARGS]`, DeepSeek, harmony); the list formats' are re-encoded from the decoded
object, and pythonic and Qwen3-Coder's are built from their literals. The end of a call is found by a scan
that knows JSON strings, so a literal `</tool_call>` inside an argument string does not end it (vLLM 45167); that
scan keeps its state between tokens, so parsing is linear in the answer (`python -m benchmarks tools`). Nothing in
the model's text can make a parser raise: every decode of it is guarded, deep nesting included.
"""

from __future__ import annotations

import re
from typing import Any

from app.openai.tools.base import ParsedAnswer, ToolCallDelta, ToolCallParser, collect, new_call_id
from app.openai.tools.deepseek import CALLS_BEGIN, DeepSeekV3ToolParser
from app.openai.tools.granite import GraniteToolParser, Phi4MiniToolParser
from app.openai.tools.harmony import HarmonyToolParser
from app.openai.tools.hermes import OPEN, HermesToolParser
from app.openai.tools.json_calls import JsonToolParser, classify_start, json_habit_calls
from app.openai.tools.llama import Llama3JsonToolParser, PythonicToolParser
from app.openai.tools.mistral import MistralToolParser
from app.openai.tools.qwen3_coder import Qwen3CoderToolParser

__all__ = ["PARSERS", "ParsedAnswer", "ToolCallDelta", "ToolCallParser", "HermesToolParser", "JsonToolParser",
           "choose_tool_format", "classify_start", "collect", "json_habit_calls", "make_parser", "new_call_id",
           "parse_tool_calls", "tool_format"]

PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser, "json": JsonToolParser, "llama3_json": Llama3JsonToolParser,
    "pythonic": PythonicToolParser, "mistral": MistralToolParser, "deepseek_v3": DeepSeekV3ToolParser,
    "granite": GraniteToolParser, "phi4_mini": Phi4MiniToolParser, "qwen3_coder": Qwen3CoderToolParser,
    "harmony": HarmonyToolParser,
}

# What in a template (or among the tokenizer's special tokens) tells the format, in the order they are tried: a
# template may name several (Qwen3-Coder's has `<tool_call>` too, Llama 3.2's `<|python_tag|>` and pythonic's
# instructions), so the most specific comes first.
SIGNS: list[tuple[str, tuple[str, ...]]] = [
    ("harmony", ("<|channel|>", "to=functions.")),
    ("deepseek_v3", (CALLS_BEGIN,)),
    ("qwen3_coder", ("<parameter=",)),
    ("mistral", ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]")),
    ("phi4_mini", ("<|/tool_call|>", "<|/tool|>")),
    ("granite", ("<|tool_call|>", "<|start_of_role|>")),
    ("hermes", (OPEN,)),
    ("pythonic", ("func_name1(", "<|python_start|>")),
    ("llama3_json", ("<|python_tag|>", "ipython")),
]


def _template_text(chat_template: str | dict | None) -> str | None:
    if isinstance(chat_template, dict):  # named templates: transformers picks "tool_use" when tools are given
        return chat_template.get("tool_use") or chat_template.get("default")
    return chat_template


def tool_format(chat_template: str | dict | list | None, special_tokens: tuple[str, ...] = ()) -> str | None:
    """The tool-call format a chat template asks for (a name of PARSERS), or None when it cannot render tools.
    `special_tokens`: the tokenizer's added tokens, for a format the template itself does not spell out."""
    if isinstance(chat_template, list):  # tokenizer_config.json's list of {"name", "template"}
        chat_template = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
    template = _template_text(chat_template)
    if not template or not re.search(r"\btools\b", template):
        return None
    for fmt, signs in SIGNS:
        if any(sign in template for sign in signs):
            return fmt
    specials = set(special_tokens)
    for fmt, signs in SIGNS:
        if any(sign in specials for sign in signs):
            return fmt
    return "json"


def choose_tool_format(tokenizer, setting: str = "auto") -> tuple[str | None, str]:
    """TOOL_CALL_PARSER: the format to parse (None: tools cannot be served), and why, for the start log."""
    template = getattr(tokenizer, "chat_template", None)
    if setting != "auto":
        if setting not in PARSERS:  # Settings refuses it first; this is for callers that build their own
            raise ValueError(f"TOOL_CALL_PARSER={setting!r} is not one of auto, {', '.join(PARSERS)}")
        return (setting if template else None), f"TOOL_CALL_PARSER={setting}"
    added = tuple(getattr(tokenizer, "get_added_vocab", dict)() or ())
    fmt = tool_format(template, added)
    return fmt, ("the chat template cannot show tools" if fmt is None else "auto, from the chat template")


# The markers each format's parser reads. Where a tokenizer marks one special (Mistral's `[TOOL_CALLS]`, gpt-oss's
# `<|channel|>`, Granite's `<|tool_call|>`), decoding drops it (app/core/detokenize.py skips special tokens), so the
# choice puts its text back from the token id before the parser sees it (app/openai/answer.py), as the reasoning
# splitters do their own markers; a marker that is an ordinary token is in the text already.
MARKERS: dict[str, tuple[str, ...]] = {
    "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
    "granite": ("<|tool_call|>",),
    "phi4_mini": ("<|tool_call|>", "<|/tool_call|>"),
    "harmony": ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>", "<|end|>"),
    "deepseek_v3": ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>"),
    "llama3_json": ("<|python_tag|>",),
    "pythonic": ("<|python_start|>", "<|python_end|>"),
    "hermes": ("<tool_call>", "</tool_call>"),
    "qwen3_coder": ("<tool_call>", "</tool_call>"),
}


def tool_markers(tokenizer, fmt: str | None) -> dict[int, str]:
    """Special token id -> marker text, for the format's markers that decoding drops."""
    from app.openai.reasoning.base import special_markers

    return special_markers(tokenizer, MARKERS.get(fmt, ())) if fmt else {}


def tool_schemas(tools) -> dict[str, Any]:
    """Tool name -> its `parameters` schema, from wire tools (pydantic) or their dicts."""
    out: dict[str, Any] = {}
    for tool in tools or ():
        fn = tool.get("function", {}) if isinstance(tool, dict) else tool.function
        name = fn.get("name") if isinstance(fn, dict) else fn.name
        params = fn.get("parameters") if isinstance(fn, dict) else fn.parameters
        out[name] = params or {}
    return out


def make_parser(fmt: str, tool_names, parallel: bool = True, schemas: dict[str, Any] | None = None) -> ToolCallParser:
    return PARSERS[fmt](tool_names, parallel, schemas)


def parse_tool_calls(text: str, fmt: str, tool_names=(), parallel: bool = True,
                     schemas: dict[str, Any] | None = None) -> ParsedAnswer:
    """The non-streamed answer: the streaming parser over the whole text at once."""
    parser = make_parser(fmt, tool_names, parallel, schemas)
    return collect(parser.feed(text) + parser.finish())
