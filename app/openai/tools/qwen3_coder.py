"""Qwen3-Coder's XML tool calls:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is text; the tool's JSON schema says its type (as vLLM's qwen3_coder parser reads it): a
string stays text (one newline after the opening and before the closing tag is the template's, not the value's),
integers and numbers are read as numbers, booleans as true/false, null as null, objects and arrays as JSON. A
value that does not read as its type stays a string, as vLLM keeps it: the model wrote that text, and the tool
sees what it wrote. A parameter the schema does not name stays a string. What makes a section no call: no
`<function=...>`, a tool not offered, or a parameter with no name.
"""

from __future__ import annotations

import json
from typing import Any

from app.openai.tools.base import loads_model_json
from app.openai.tools.sections import SectionParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


def typed_value(text: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema's type asks for; the text itself if it is no such value."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = kinds if isinstance(kinds, list) else [kinds]
    for kind in kinds:
        try:
            if kind == "integer":
                return int(text.strip())
            if kind == "number":
                value = loads_model_json(text.strip())
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    return value
            if kind == "boolean" and text.strip().lower() in ("true", "false"):
                return text.strip().lower() == "true"
            if kind == "null" and text.strip().lower() in ("null", "none"):
                return None
            if kind in ("object", "array"):
                value = loads_model_json(text)
                if isinstance(value, dict if kind == "object" else list):
                    return value
        except ValueError:
            continue
    return text


def qwen3_coder_call(body: str, tool_names: frozenset[str], schemas: dict[str, Any]) -> tuple[str, str] | None:
    before, sep, rest = body.partition(FUNCTION)
    if not sep or before.strip():
        return None
    name, bracket, rest = rest.partition(">")
    name = name.strip()
    if not bracket or not name or any(ch.isspace() for ch in name) or (tool_names and name not in tool_names):
        return None
    inner, _, after = rest.partition(FUNCTION_END)
    if after.strip():
        return None
    properties = (schemas.get(name) or {}).get("properties") or {}
    args: dict[str, Any] = {}
    parts = inner.split(PARAMETER)
    if parts[0].strip():
        return None  # text inside the function but outside any parameter
    for part in parts[1:]:
        pname, bracket, value = part.partition(">")
        if not bracket or not pname.strip():
            return None
        value = value.split(PARAMETER_END, 1)[0]
        value = value.removeprefix("\n").removesuffix("\n")
        args[pname.strip()] = typed_value(value, properties.get(pname.strip()))
    try:
        return name, json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return None


class Qwen3CoderToolParser(SectionParser):
    OPENS = (OPEN, FUNCTION)  # the bare `<function=` is a habit: the model leaves out `<tool_call>`
    STRING_AWARE = False  # the body is XML: quotes in a value mean nothing

    def close_for(self, marker: str) -> str | None:
        return CLOSE if marker == OPEN else FUNCTION_END

    def parse_section(self, text: str) -> list[tuple[str, str]] | None:
        body = text.removeprefix(OPEN).removesuffix(CLOSE) if text.startswith(OPEN) else text
        call = qwen3_coder_call(body.strip(), self.tool_names, self.schemas)
        return [call] if call else None
