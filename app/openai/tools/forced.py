"""Forced calls (`tool_choice: "required"` or a named tool) as an xgrammar structural tag, in each format's own
spelling: the model writes only calls, in the shape it was trained on, so the format's parser reads them back,
streamed or not.

Each format is described by how one call of tool NAME is written around its arguments (`begin`, `end`), what
separates calls, and what wraps the whole list (`[TOOL_CALLS][` ... `]`). Arguments are JSON valid against the
tool's `parameters`, except in two formats: Qwen3-Coder writes them as `<parameter=...>` XML, which xgrammar's
"qwen_xml" style checks against the same schema; pythonic calls write Python keyword arguments, which a grammar
checks only for shape (the tool's parameter names, each a literal: string, number, True/False/None, list, dict),
not for the schema's types. Harmony ends a call with `<|call|>`, one of gpt-oss's stop tokens, so its call has no
end text: the stop token ends it, and one call is allowed per answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CallShape:
    begin: str  # before the arguments; {name} is the tool's name (JSON-quoted where `quoted`)
    end: str
    separator: str = "\n"
    prefix: str = ""  # before the first call
    suffix: str = ""  # after the last
    quoted: bool = True  # the name goes in as a JSON string
    single: bool = False  # the format holds one call per answer
    content: str = "json"  # "json", "qwen_xml" or "pythonic"


DEEPSEEK_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n"
SHAPES: dict[str, CallShape] = {
    "hermes": CallShape('<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>"),
    "json": CallShape('{{"name": {name}, "arguments": ', "}", single=True),  # read as one call per answer
    "llama3_json": CallShape('{{"name": {name}, "parameters": ', "}", separator="; "),
    "pythonic": CallShape("{name}(", ")", separator=", ", prefix="[", suffix="]", quoted=False, content="pythonic"),
    "mistral": CallShape('{{"name": {name}, "arguments": ', "}", separator=", ", prefix="[TOOL_CALLS][", suffix="]"),
    "deepseek_v3": CallShape(DEEPSEEK_CALL, "\n```<｜tool▁call▁end｜>", prefix="<｜tool▁calls▁begin｜>",
                             suffix="<｜tool▁calls▁end｜>", quoted=False),
    "granite": CallShape('{{"name": {name}, "arguments": ', "}", separator=", ", prefix="<|tool_call|>[",
                         suffix="]"),
    "phi4_mini": CallShape('{{"name": {name}, "arguments": ', "}", separator=", ", prefix="<|tool_call|>[",
                           suffix="]<|/tool_call|>"),
    "qwen3_coder": CallShape("<tool_call>\n<function={name}>\n", "\n</function>\n</tool_call>", quoted=False,
                             content="qwen_xml"),
    "harmony": CallShape("<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>", "",
                         quoted=False, single=True),
}

# A Python literal as the pythonic format writes one (JSON's strings, numbers, and Python's True/False/None).
PYTHON_LITERAL_EBNF = r"""
value ::= string | number | "True" | "False" | "None" | list | dict
string ::= "\"" ([^"\\\n] | "\\" ["\\/bfnrt])* "\""
number ::= "-"? ("0" | [1-9] [0-9]{0,15}) ("." [0-9]{1,16})?
list ::= "[" (value (", " value){0,63})? "]"
dict ::= "{" (string ": " value (", " string ": " value){0,63})? "}"
"""


def pythonic_arguments(schema: dict[str, Any]) -> dict[str, Any]:
    """A grammar for `a=1, b="x"`: the tool's parameter names, each once at most, in the schema's order."""
    names = [n for n in (schema.get("properties") or {}) if n.isidentifier()]
    if not names:
        return {"type": "grammar", "grammar": "root ::= \"\"\n" + PYTHON_LITERAL_EBNF}
    kwargs = " | ".join(json.dumps(n + "=") + " value" for n in names)
    rule = f"root ::= (kwarg (\", \" kwarg){{0,{len(names) - 1}}})?\nkwarg ::= {kwargs}\n"
    return {"type": "grammar", "grammar": rule + PYTHON_LITERAL_EBNF}


def call_content(shape: CallShape, schema: dict[str, Any], max_whitespace: int) -> dict[str, Any]:
    if shape.content == "pythonic":
        return pythonic_arguments(schema)
    content = {"type": "json_schema", "json_schema": schema}
    if shape.content == "qwen_xml":
        return content | {"style": "qwen_xml"}
    return content | {"max_whitespace_cnt": max_whitespace}


def forced_calls_format(fmt: str, tools: list[tuple[str, dict[str, Any]]], parallel: bool,
                        max_whitespace: int) -> dict[str, Any]:
    """The structural tag's `format`: one or more calls (one when not `parallel`) of `tools`, (name, schema)
    pairs, in format `fmt`, and nothing else."""
    shape = SHAPES[fmt]
    tags = [{"type": "tag",
             "begin": shape.begin.format(name=json.dumps(name, ensure_ascii=False) if shape.quoted else name),
             "content": call_content(shape, schema, max_whitespace), "end": shape.end}
            for name, schema in tools]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": shape.separator, "at_least_one": True,
             "stop_after_first": not parallel or shape.single}
    if not shape.prefix and not shape.suffix:
        return calls
    return {"type": "sequence", "elements": [{"type": "const_string", "value": shape.prefix}, calls,
                                             {"type": "const_string", "value": shape.suffix}]}
