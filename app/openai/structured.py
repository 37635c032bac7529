"""What a chat request asks the grammar to enforce: a `response_format`, or the forced tool calls of `tool_choice`.

  * `{"type": "json_object"}` -> any JSON object (the schema `{"type": "object"}`, as vLLM maps it);
  * `{"type": "json_schema", "json_schema": {"schema": ...}}` -> that schema;
  * `tool_choice: "required"` or a named tool -> calls in the template's own format, each an offered tool's name and
    arguments valid against its `parameters` (vLLM builds one JSON schema for this; a structural tag keeps the
    model in the format it was trained on, so the ordinary tool-call parser reads the answer, streamed or not).

The grammar itself is compiled by app/core/structured/grammars.py, which knows nothing of OpenAI.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request

from app.core.structured.grammars import MAX_WHITESPACE, Grammar, Grammars
from app.core.structured.schema_check import GrammarLimits, SchemaCost, check_schema
from app.openai.tools.wire import ResponseFormat, Tool

# Each call's text around its arguments, by tool-call format (see app/openai/tools/).
CALL_SHAPES = {
    "hermes": ('<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>", "\n"),
    "json": ('{{"name": {name}, "arguments": ', "}", "\n"),
}


async def request_grammar(grammars: Grammars, body, tool_format: str | None, client: str) -> Grammar | None:
    """The grammar of a chat request (a ChatCompletionRequest), if it asks for one, compiled for `client`."""
    if body.forced_tools:
        tag = await asyncio.to_thread(forced_tool_tag, tool_format, body.forced_tools, body.parallel_tool_calls,
                                      grammars.limits)
        return await grammars.structural_tag_async(tag, client=client)
    if body.json_format:
        return await grammars.json_schema_async(response_schema(body.response_format), client=client)
    return None


def response_schema(response_format: ResponseFormat) -> dict[str, Any]:
    if response_format.type == "json_object":
        return {"type": "object"}
    return response_format.json_schema.schema_


def forced_tool_tag(fmt: str, tools: list[Tool], parallel: bool, limits: GrammarLimits) -> dict[str, Any]:
    """An xgrammar structural tag: one or more calls of the given tools and nothing else, then EOS."""
    begin, end, separator = CALL_SHAPES[fmt]
    tags = []
    cost = SchemaCost()  # one grammar holds every tool's schema: their sizes add up
    for i, tool in enumerate(tools):
        schema = tool.function.parameters or {"type": "object"}
        check_schema(schema, param=f"tools.{i}.function.parameters", limits=limits, cost=cost)
        tags.append({"type": "tag", "begin": begin.format(name=json.dumps(tool.function.name, ensure_ascii=False)),
                     "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE},
                     "end": end})
    # the bare-JSON format reads one call per answer, so it is forced to one
    single = not parallel or fmt == "json"
    return {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": tags,
                                                 "separator": separator, "at_least_one": True,
                                                 "stop_after_first": single}}


def compile_client(request: Request | None, header: str | None) -> str:
    """Who a grammar compile is charged to (GRAMMAR_COMPILE_PER_CLIENT): the value of the header a trusted proxy
    sets (GRAMMAR_CLIENT_HEADER), when one is configured and sent, else the peer's address. Behind a proxy every
    peer address is the proxy's, so without the header all its users count as one client. Never the API key: one
    key is shared by every client, and without API_KEY any client could send a new one with each request."""
    if request is None:
        return ""
    if header and (named := request.headers.get(header, "").strip()):
        return "header:" + named
    return "peer:" + (request.client.host if request.client else "")
