"""Whatever a constraint holds, checking it never fails the server (issue 45, finding 3): a schema `format` given as
a list (unhashable where the checker looked it up), a regex bound of 5,000 digits (more than `int()` reads), a
schema string nested past the JSON parser's recursion limit: each was a 500. Each is now a 400 naming the field it
came in, on every route that takes one (chat and text `guided_*`, `response_format`, Responses `text.format`,
forced tool parameters, Anthropic's `input_schema`), and any exception nobody foresaw while checking or compiling a
constraint is one too, logged with its traceback."""

from __future__ import annotations

import asyncio
import logging
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import app.structured.grammars as grammars_module
from app.structured.schema_check import ENFORCED, GrammarLimits, check_schema, pattern_repeat
from app.structured.grammars import check_text
from app.errors import InvalidRequest
from test_tools_api import hermes_lm, hermes_server  # noqa: F401 - shared fixtures

LIST_FORMAT = {"type": "string", "format": ["email"]}
HUGE_BOUND = "a{" + "9" * 5000 + "}"
DEEP_JSON = "[" * 100_000 + "]" * 100_000  # a schema sent as a string: the body's depth check never sees inside
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 8}


def tool(parameters) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


# (route, the body's own fields, the `param` the error must name)
CASES = [
    ("/v1/chat/completions", {"guided_json": LIST_FORMAT}, "guided_json"),
    ("/v1/completions", {"guided_json": LIST_FORMAT}, "guided_json"),
    ("/v1/completions", {"guided_regex": HUGE_BOUND}, "guided_regex"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": HUGE_BOUND}}, "structured_outputs.regex"),
    ("/v1/chat/completions", {"guided_json": DEEP_JSON}, "guided_json"),
    ("/v1/completions", {"structured_outputs": {"json": DEEP_JSON}}, "structured_outputs.json"),
    ("/v1/completions", {"guided_json": '{"type": "array", "minItems": ' + "9" * 5000 + "}"}, "guided_json"),
    ("/v1/completions", {"guided_json": '{"type": "number", "maximum": NaN}'}, "guided_json"),
    ("/v1/chat/completions", {"json_schema": {"type": "string", "pattern": HUGE_BOUND}}, "json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": LIST_FORMAT}}}, "response_format"),
    ("/v1/chat/completions", {"tools": [tool({"type": "object", "properties": {"d": LIST_FORMAT}})],
                              "tool_choice": "required"}, "tools.0.function.parameters"),
    ("/v1/chat/completions", {"tools": [tool({"type": "object", "properties": {"d": LIST_FORMAT}})],
                              "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools.0.function.parameters"),
    ("/v1/chat/completions", {"tools": [tool({"type": "object", "properties": {
        "d": {"type": "string", "pattern": HUGE_BOUND}}})], "tool_choice": "required"},
     "tools.0.function.parameters"),
]
RESPONSES_CASES = [
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": LIST_FORMAT}}}, "text.format"),
    # the chat request's name for the field (tools.0.function.parameters): Responses renames only its top-level ones
    ({"tools": [{"type": "function", "name": "f", "parameters": LIST_FORMAT}], "tool_choice": "required"},
     "tools.0."),
]
# Anthropic's errors carry no `param`: the message names the keyword and its place
MESSAGES_CASES = [
    {"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"d": LIST_FORMAT}}}],
     "tool_choice": {"type": "any"}},
    {"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"d": {
        "type": "string", "pattern": HUGE_BOUND}}}}], "tool_choice": {"type": "tool", "name": "f"}},
    {"output_config": {"format": {"type": "json_schema", "schema": LIST_FORMAT}}},
]


def assert_names(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param or param.endswith(".") and r.json()["error"]["param"].startswith(
        param), r.json()


def test_the_unhashable_format_and_the_huge_bound_are_refused_by_the_checkers_themselves():
    with pytest.raises(InvalidRequest) as err:
        check_schema(LIST_FORMAT, "guided_json")
    assert err.value.param == "guided_json" and "/format" in err.value.message
    with pytest.raises(InvalidRequest) as err:
        check_text("regex", HUGE_BOUND, "guided_regex", GrammarLimits())
    assert err.value.param == "guided_regex" and "GRAMMAR_MAX_REPEAT" in err.value.message
    assert pattern_repeat("((a{" + "9" * 5000 + "}){99999999999999999999}){9}") > GrammarLimits().max_repeat


def test_negative_item_bounds_cannot_buy_room_for_other_repetitions():
    schema = {"type": "object", "properties": {
        "a": {"type": "array", "minItems": -10**6},
        "b": {"type": "string", "pattern": "(x{0,999}){0,1}"}, "c": {"type": "string", "pattern": "y{0,999}"},
        "d": {"type": "string", "pattern": "z{0,999}"}, "e": {"type": "string", "pattern": "w{0,999}"},
        "f": {"type": "string", "pattern": "v{0,999}"}}}
    with pytest.raises(InvalidRequest) as err:
        check_schema(schema, "response_format")
    assert "GRAMMAR_MAX_TOTAL_REPEAT" in err.value.message


@pytest.mark.parametrize("route, fields, param", CASES)
def test_a_hostile_constraint_is_a_400_naming_its_field(hermes_server, route, fields, param):
    body = dict(CHAT, **fields) if "chat" in route else {"model": "tiny", "prompt": "x", "max_tokens": 8, **fields}
    assert_names(httpx.post(hermes_server.url + route, json=body, timeout=60), param)


@pytest.mark.parametrize("fields, param", RESPONSES_CASES)
def test_through_the_responses_api_too(hermes_server, fields, param):
    body = {"model": "tiny", "input": "JSON please", "max_output_tokens": 8, **fields}
    assert_names(httpx.post(hermes_server.url + "/v1/responses", json=body, timeout=60), param)


@pytest.mark.parametrize("fields", MESSAGES_CASES)
def test_through_anthropics_messages_too(hermes_server, fields):
    body = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "JSON please"}], **fields}
    r = httpx.post(hermes_server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "/format" in r.json()["error"]["message"] or "/pattern" in r.json()["error"]["message"]


class Unforeseen(Exception):
    pass


def raise_unforeseen(*args, **kwargs):
    raise Unforeseen("a bug in a checker")


@pytest.mark.parametrize("target", ["check_schema", "check_text"])
def test_an_exception_nobody_foresaw_while_checking_is_a_400_naming_the_field_and_logged(
        hermes_server, monkeypatch, caplog, target):
    monkeypatch.setattr(grammars_module, target, raise_unforeseen)
    fields = {"guided_json": {"type": "object"}} if target == "check_schema" else {"guided_regex": "ab+"}
    with caplog.at_level(logging.WARNING, logger="app.structured.grammars"):
        r = httpx.post(hermes_server.url + "/v1/chat/completions", json=dict(CHAT, **fields), timeout=60)
    param = next(iter(fields))
    assert_names(r, param)
    assert "Unforeseen" not in r.text and "a bug" not in r.text  # the client learns the field, not our internals
    logged = [rec for rec in caplog.records if param in rec.getMessage()]
    assert logged and logged[0].exc_info and logged[0].exc_info[0] is Unforeseen


def test_an_exception_nobody_foresaw_in_a_forced_tools_check_names_that_tool(hermes_server, monkeypatch):
    import app.openai.structured as structured

    monkeypatch.setattr(structured, "check_schema", raise_unforeseen)
    body = dict(CHAT, tools=[tool({"type": "object"})], tool_choice="required")
    assert_names(httpx.post(hermes_server.url + "/v1/chat/completions", json=body, timeout=60),
                 "tools.0.function.parameters")


class UnforeseenPool:
    def __init__(self, *args):
        pass

    compile = staticmethod(raise_unforeseen)

    def close(self):
        pass


def test_an_exception_nobody_foresaw_while_compiling_is_a_400_too(tiny_lm, monkeypatch):
    monkeypatch.setattr(grammars_module, "CompilePool", UnforeseenPool)
    grammars = grammars_module.Grammars(tiny_lm.tokenizer, tiny_lm.vocab_size, tiny_lm.eos_ids)
    try:
        with pytest.raises(InvalidRequest) as err:
            grammars.json_schema({"type": "object"}, param="response_format")
        assert err.value.param == "response_format"
        with pytest.raises(InvalidRequest) as err:
            asyncio.run(grammars.text_async("regex", "ab+", "structured_outputs.regex"))
        assert err.value.param == "structured_outputs.regex"
    finally:
        grammars.close()


# Odd JSON values, and some that JSON cannot even carry but a caller in Python can (huge ints, NaN).
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(min_value=10**4400, max_value=10**4500)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
           | st.sampled_from(["email", "a{" + "9" * 4400 + "}", "(a{0,99}){0,99}", "[", "\\", "{", "a{3,"]))
KEYS = st.sampled_from(sorted(ENFORCED) + ["title", "not", "if"]) | st.text(max_size=4)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
                      max_leaves=30)


def deeply_nested(depth: int) -> dict:
    value: object = "x"
    for _ in range(depth):
        value = [value]
    return {"type": "array", "enum": [value]}


@pytest.mark.full
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=st.dictionaries(KEYS, VALUES, max_size=6) | VALUES)
def test_the_schema_checker_only_ever_accepts_or_raises_invalid_request(schema):
    try:
        check_schema(schema, "response_format")
    except InvalidRequest as err:
        assert err.param == "response_format"


@pytest.mark.full
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pattern=st.text(alphabet="ab(){},0123456789[]^\\|*+?", max_size=60)
       | st.builds(lambda digits, n: "a{" + "9" * n + "," + digits + "}", st.text("0123456789"), st.integers(0, 9000))
       | SCALARS)
def test_the_regex_checker_only_ever_accepts_or_raises_invalid_request(pattern):
    try:
        check_text("regex", pattern, "guided_regex", GrammarLimits())
    except InvalidRequest as err:
        assert err.param == "guided_regex"


@pytest.mark.parametrize("schema", [deeply_nested(100_000), {"enum": [math.nan, math.inf, 10**5000]},
                                    {"minItems": 10**5000, "type": "array"}, {"format": {"a": 1}},
                                    {"properties": {"a": {"pattern": ["x"]}}}])
def test_values_json_cannot_carry_are_refused_or_accepted_never_raised(schema):
    try:
        check_schema(schema, "response_format")
    except InvalidRequest as err:
        assert err.param == "response_format"
