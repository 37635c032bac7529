"""What a chat request asks the grammar to enforce: a `response_format`, or the forced tool calls of `tool_choice`.

  * `{"type": "json_object"}` -> any JSON object (the schema `{"type": "object"}`, as vLLM maps it);
  * `{"type": "json_schema", "json_schema": {"schema": ...}}` -> that schema;
  * `tool_choice: "required"` or a named tool -> calls in the template's own format, each an offered tool's name and
    arguments valid against its `parameters` (vLLM builds one JSON schema for this; a structural tag keeps the
    model in the format it was trained on, so the ordinary tool-call parser reads the answer, streamed or not).

The grammar itself is compiled by app/core/constraints.py, which knows nothing of OpenAI.
"""

from __future__ import annotations

import json
from typing import Any

from app.core.constraints import MAX_WHITESPACE
from app.core.schema_check import GrammarLimits, check_schema
from app.openai.tools.wire import ResponseFormat, Tool

# Each call's text around its arguments, by tool-call format (see app/openai/tools/).
CALL_SHAPES = {
    "hermes": ('<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>", "\n"),
    "json": ('{{"name": {name}, "arguments": ', "}", "\n"),
}


def response_schema(response_format: ResponseFormat) -> dict[str, Any]:
    if response_format.type == "json_object":
        return {"type": "object"}
    return response_format.json_schema.schema_


def forced_tool_tag(fmt: str, tools: list[Tool], parallel: bool, limits: GrammarLimits) -> dict[str, Any]:
    """An xgrammar structural tag: one or more calls of the given tools and nothing else, then EOS."""
    begin, end, separator = CALL_SHAPES[fmt]
    tags = []
    for i, tool in enumerate(tools):
        schema = tool.function.parameters or {"type": "object"}
        check_schema(schema, param=f"tools.{i}.function.parameters", limits=limits)
        tags.append({"type": "tag", "begin": begin.format(name=json.dumps(tool.function.name, ensure_ascii=False)),
                     "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE},
                     "end": end})
    # the bare-JSON format reads one call per answer, so it is forced to one
    single = not parallel or fmt == "json"
    return {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": tags,
                                                 "separator": separator, "at_least_one": True,
                                                 "stop_after_first": single}}
