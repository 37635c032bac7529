"""What a request asks the grammar to enforce: a constraint in one of the peers' spellings (vLLM's
`structured_outputs` and `guided_*`, llama.cpp's `grammar` and `json_schema`, TGI's `grammar`: a JSON schema, a
regex, a choice of strings, or an EBNF grammar), a chat `response_format`, or the forced tool calls of `tool_choice`.

  * `{"type": "json_object"}` -> any JSON object (the schema `{"type": "object"}`, as vLLM maps it);
  * `{"type": "json_schema", "json_schema": {"schema": ...}}` -> that schema;
  * `tool_choice: "required"` or a named tool -> calls in the template's own format, each an offered tool's name and
    arguments valid against its `parameters` (vLLM builds one JSON schema for this; a structural tag keeps the
    model in the format it was trained on, so the ordinary tool-call parser reads the answer, streamed or not).

The grammar itself is compiled by app/structured/grammars.py, which knows nothing of OpenAI, and cached there per
tenant: the caller's API-key tenant where the prefix cache is salted by key (app/api.py), so one tenant cannot
tell by latency which schemas another sent. A schema sent as a string is parsed as strictly as a request body
(no NaN or Infinity; nesting past the parser's reach is a 400, not a RecursionError).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request

from app.body import NotFinite, finite_float, no_constant
from app.structured.grammars import MAX_WHITESPACE, Grammar, Grammars, refusing_as_invalid
from app.structured.schema_check import GrammarLimits, SchemaCost, check_schema
from app.errors import InvalidRequest
from app.openai.tools.forced import forced_calls_format
from app.openai.tools.wire import ResponseFormat, Tool


async def request_grammar(grammars: Grammars, body, tool_format: str | None, client: str,
                          tenant: str | None = None) -> Grammar | None:
    """The grammar of a chat or text completion request, if it asks for one, compiled for `client` (whose turn it
    is) into `tenant`'s cache."""
    if (constraint := request_constraint(body)) is not None:
        kind, spec, param = constraint
        if kind == "json_schema":
            return await grammars.json_schema_async(spec, param=param, client=client, tenant=tenant)
        return await grammars.text_async(kind, spec, param, client=client, tenant=tenant)
    if not hasattr(body, "forced_tools"):  # text completions have neither tools nor response_format
        return None
    if body.forced_tools:
        tag = await asyncio.to_thread(forced_tool_tag, tool_format, body.forced_tools, body.parallel_tool_calls,
                                      grammars.limits)
        return await grammars.structural_tag_async(tag, client=client, tenant=tenant)
    if body.json_format:
        return await grammars.json_schema_async(response_schema(body.response_format), client=client, tenant=tenant)
    return None


def request_constraint(body) -> tuple[str, Any, str] | None:
    """The one constraint the request's peer-spelled fields ask for: (kind, spec, the field it came from), kind
    being "json_schema", "regex" or "grammar"; None if none is set. Two at once is a 400 naming both."""
    found: list[tuple[str, Any, str]] = []
    if (so := body.structured_outputs) is not None:
        set_ = [(name, value) for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                                  ("grammar", so.grammar)) if value is not None]
        if len(set_) != 1:
            raise InvalidRequest("structured_outputs takes exactly one of json, regex, choice, grammar; got "
                                 f"{', '.join(n for n, _ in set_) or 'none'}", param="structured_outputs")
        found.append(_constraint(*set_[0], f"structured_outputs.{set_[0][0]}"))
    for name in ("json", "regex", "choice", "grammar"):  # vLLM's older spelling
        if (value := getattr(body, f"guided_{name}")) is not None:
            found.append(_constraint(name, value, f"guided_{name}"))
    if isinstance(body.grammar, str):  # llama.cpp: a GBNF grammar
        found.append(("grammar", body.grammar, "grammar"))
    elif body.grammar is not None:  # TGI: {"type": "json" | "regex", "value": ...}
        found.append(_constraint("regex" if body.grammar.type == "regex" else "json", body.grammar.value,
                                 "grammar.value"))
    if body.json_schema is not None:  # llama.cpp
        found.append(("json_schema", body.json_schema, "json_schema"))
    if getattr(body, "json_format", False) or getattr(body, "forced_tools", None):
        found.append(("response_format", None, "response_format"))
    if len(found) > 1:
        raise InvalidRequest(f"one constraint per request: `{found[0][2]}` and `{found[1][2]}` are both set",
                             param=found[1][2])
    return found[0] if found and found[0][0] != "response_format" else None


def _constraint(name: str, value: Any, param: str) -> tuple[str, Any, str]:
    if name == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value, parse_constant=no_constant, parse_float=finite_float)
            except NotFinite as err:
                raise InvalidRequest(f"`{param}` is not a JSON schema: {err} is not a JSON number (NaN and "
                                     "infinities are not allowed)", param=param) from None
            except json.JSONDecodeError as err:
                raise InvalidRequest(f"`{param}` is not a JSON schema: {err}", param=param) from None
            except (ValueError, RecursionError):  # an integer of more than 4,300 digits; nesting past the parser
                raise InvalidRequest(f"`{param}` is not a JSON schema the server can read: it nests too deep or "
                                     "holds a number too long", param=param) from None
        return "json_schema", value, param
    if name == "choice":
        return "grammar", choice_grammar(value, param), param
    return name, value, param


def choice_grammar(choices: list[str], param: str) -> str:
    """An EBNF grammar whose only sentences are the given strings (JSON string escapes are EBNF's too)."""
    if not choices:
        raise InvalidRequest(f"`{param}` needs at least one choice", param=param)
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def response_schema(response_format: ResponseFormat) -> dict[str, Any]:
    if response_format.type == "json_object":
        return {"type": "object"}
    return response_format.json_schema.schema_


def forced_tool_tag(fmt: str, tools: list[Tool], parallel: bool, limits: GrammarLimits) -> dict[str, Any]:
    """An xgrammar structural tag: one or more calls of the given tools and nothing else, then EOS."""
    cost = SchemaCost()  # one grammar holds every tool's schema: their sizes add up
    schemas = []
    for i, tool in enumerate(tools):
        schema = tool.function.parameters or {"type": "object"}
        param = f"tools.{i}.function.parameters"
        with refusing_as_invalid(param):
            check_schema(schema, param=param, limits=limits, cost=cost)
        schemas.append((tool.function.name, schema))
    # each format's own spelling of its calls (app/openai/tools/forced.py)
    return {"type": "structural_tag", "format": forced_calls_format(fmt, schemas, parallel, MAX_WHITESPACE)}


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
