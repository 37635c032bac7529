"""response_format and forced tool_choice over HTTP on the tiny model: whatever the random model wants, the answer
is a valid document or a valid call, streamed or not, with n > 1, seeds and logprobs."""

from __future__ import annotations

import json

import httpx
import pytest

from test_api import sse_payloads
from test_tools_api import hermes_lm, hermes_server  # noqa: F401 - shared fixtures

CHAT = "/v1/chat/completions"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
          "required": ["ok", "color"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
NOOP = {"type": "function", "function": {"name": "noop"}}


def post(url: str, json: dict) -> httpx.Response:
    return httpx.post(url, json=json, timeout=60)  # the first grammar also builds the tokenizer's tables


def body(**extra):
    return {"model": "tiny", "messages": [{"role": "user", "content": "JSON please"}], "temperature": 0,
            "max_tokens": 60, **extra}


@pytest.mark.full
def test_json_schema_answers_are_valid_streamed_or_not_with_n_seed_and_logprobs(hermes_server):
    url = hermes_server.url + CHAT
    r = post(url, body(response_format=JSON_SCHEMA, n=2, temperature=1.0, seed=7, logprobs=True))
    assert r.status_code == 200, r.text
    assert json.loads(r.headers["x-sampling-params"])["grammar"] == "json_schema"
    choices = r.json()["choices"]
    for choice in choices:
        assert choice["finish_reason"] == "stop"
        assert json.loads(choice["message"]["content"])["color"] in ("red", "green")
        assert len(choice["logprobs"]["content"]) >= 5
    again = post(url, body(response_format=JSON_SCHEMA, n=2, temperature=1.0, seed=7)).json()
    assert [c["message"]["content"] for c in again["choices"]] == [c["message"]["content"] for c in choices]

    with httpx.stream("POST", url, timeout=60, json=body(response_format=JSON_SCHEMA, n=2, temperature=1.0, seed=7,
                                             stream=True)) as s:
        chunks = [c for c in sse_payloads(s) if c != "[DONE]"]
    for choice in choices:
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                       if c["choices"] and c["choices"][0]["index"] == choice["index"])
        assert text == choice["message"]["content"]


def test_json_object_gives_an_object(hermes_server):
    r = post(hermes_server.url + CHAT, body(response_format={"type": "json_object"}, max_tokens=120))
    choice = r.json()["choices"][0]
    assert choice["message"]["content"].lstrip().startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_always_calls_an_offered_tool_with_valid_arguments(hermes_server, tool_choice):
    r = post(hermes_server.url + CHAT, body(tools=[CITY, NOOP], tool_choice=tool_choice, max_tokens=140))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert calls and all(c["function"]["name"] in ("get_weather", "noop") for c in calls)
    if isinstance(tool_choice, dict):
        assert {c["function"]["name"] for c in calls} == {"get_weather"}
    for c in calls:
        args = json.loads(c["function"]["arguments"])
        assert args == {} if c["function"]["name"] == "noop" else args["city"] in ("Paris", "Rome")


def test_forced_tool_choice_streams_tool_call_deltas(hermes_server):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    with httpx.stream("POST", hermes_server.url + CHAT, timeout=60,
                      json=body(tools=[CITY], tool_choice=tool_choice, stream=True, parallel_tool_calls=False,
                                max_tokens=140)) as s:
        chunks = [c for c in sse_payloads(s) if c != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads("".join(t["function"]["arguments"] for t in calls))["city"] in ("Paris", "Rome")
    assert not "".join(d.get("content") or "" for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format", "'not'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     "schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"d": {"type": "string", "format": "idn-email"}}}}}],
      "tool_choice": "required"}, "tools.0.function.parameters", "idn-email"),
    ({"tools": [CITY], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "tool_choice"),
])
def test_what_cannot_be_enforced_is_a_400_naming_it(hermes_server, extra, param, words):
    r = post(hermes_server.url + CHAT, body(**extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"]


def test_responses_api_text_format_is_enforced_too(hermes_server):
    fmt = {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}
    r = post(hermes_server.url + "/v1/responses", {"model": "tiny", "input": "JSON please", "temperature": 0,
                                                    "max_output_tokens": 60, "text": {"format": fmt}})
    assert r.status_code == 200, r.text
    texts = [p["text"] for item in r.json()["output"] if item["type"] == "message" for p in item["content"]]
    assert json.loads("".join(texts))["color"] in ("red", "green")
