"""Constraints beyond JSON Schema, in each peer's spelling: vLLM's `structured_outputs` (`regex`, `choice`,
`grammar`, `json`) and `guided_*`, llama.cpp's GBNF `grammar`, TGI's `grammar` object. On chat and text
completions, streamed or not, greedy or sampled, the answer always matches its constraint; a bad or hostile one is
a 400 naming its field (and the position, for a syntax error), and hurts only its own request."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from app.config import Settings
from app.main import create_app
from conftest import ThreadServer

# (the request's fields, what every answer must fully match: a Python regex, the same language)
CONSTRAINTS = {
    "regex": ({"structured_outputs": {"regex": r"\d{3}-[a-z]{2,4}"}}, r"\d{3}-[a-z]{2,4}"),
    "choice": ({"structured_outputs": {"choice": ["yes", "no", 'say "maybe"\nlater']}}, r'yes|no|say "maybe"\nlater'),
    "grammar": ({"structured_outputs": {"grammar": 'root ::= "x=" [0-9] [0-9]? ("," [0-9])*'}},
                r"x=[0-9][0-9]?(,[0-9])*"),
    "guided_regex": ({"guided_regex": "(cat|dog)s?"}, r"(cat|dog)s?"),
    "gbnf": ({"grammar": 'root ::= answer\nanswer ::= ("a" | "b"){2,5}  # llama.cpp style'}, r"[ab]{2,5}"),
    "tgi_regex": ({"grammar": {"type": "regex", "value": "[A-Z]{3}"}}, r"[A-Z]{3}"),
}
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Answer, please."}]})
TEXT = ("/v1/completions", {"prompt": "The answer is"})


@pytest.fixture(scope="module")
def server(tiny_lm):
    with ThreadServer(create_app(Settings(model="tiny"), lm=tiny_lm)) as srv:
        yield srv


def answer_text(path: str, body: dict, url: str) -> tuple[str, str]:
    """(the answer's text, its finish reason), streamed or not as the body says."""
    if not body.get("stream"):
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return (choice["message"]["content"] if "message" in choice else choice["text"]), choice["finish_reason"]
    parts, reason = [], None
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        for choice in json.loads(line[6:])["choices"]:
            parts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
            reason = choice["finish_reason"] or reason
    return "".join(parts), reason


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_a_sampled_answer_matches_its_constraint(server, name):
    fields, pattern = CONSTRAINTS[name]
    body = {"model": "tiny", "max_tokens": 40, "temperature": 1.0, **TEXT[1], **fields}
    text, reason = answer_text(TEXT[0], body, server.url)
    assert reason == "stop" and re.fullmatch(pattern, text), (text, reason)


@pytest.mark.full
@pytest.mark.parametrize("endpoint", [CHAT, TEXT], ids=["chat", "text"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("temperature", [0, 1.0])
@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_every_answer_matches_its_constraint(server, name, temperature, stream, endpoint):
    fields, pattern = CONSTRAINTS[name]
    path, prompt = endpoint
    for seed in range(2 if temperature else 1):
        body = {"model": "tiny", "max_tokens": 40, "temperature": temperature, "seed": seed, "stream": stream,
                **prompt, **fields}
        text, reason = answer_text(path, body, server.url)
        assert reason == "stop" and re.fullmatch(pattern, text), (text, reason)


def test_guided_json_and_llama_cpp_json_schema_give_json_of_the_schema(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    for fields in ({"guided_json": schema}, {"json_schema": schema}, {"structured_outputs": {"json": json.dumps(schema)}}):
        body = {"model": "tiny", "prompt": "JSON:", "max_tokens": 60, "temperature": 0, **fields}
        text, reason = answer_text("/v1/completions", body, server.url)
        if reason == "stop":  # a random model may write whitespace until max_tokens; a finished answer is valid
            assert isinstance(json.loads(text)["n"], int)


@pytest.mark.parametrize("fields, param, words", [
    ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs.regex", "position 5"),
    ({"structured_outputs": {"grammar": 'root ::= "a" b'}}, "structured_outputs.grammar", "line 1, column 14"),
    ({"grammar": 'root ::= ( "x" '}, "grammar", "column"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", ""),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one constraint"),
    ({"structured_outputs": {"regex": "(a{0,100}){0,100}"}}, "structured_outputs.regex", "GRAMMAR_MAX_REPEAT"),
    ({"structured_outputs": {"regex": "a" * 70000}}, "structured_outputs.regex", "at most"),
    ({"structured_outputs": {"regex": "  "}}, "structured_outputs.regex", "empty"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not a JSON schema"),
    ({"structured_outputs": {"regex": "a", "unknown": 1}}, "structured_outputs", ""),
    ({"grammar": {"type": "xml", "value": "<a/>"}}, "grammar", ""),
])
def test_bad_constraints_get_a_400_naming_the_field(server, fields, param, words):
    for path, prompt in (CHAT, TEXT):
        r = httpx.post(server.url + path, json={"model": "tiny", "max_tokens": 8, **prompt, **fields}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert param in (error["param"] or "") + error["message"] and words in error["message"], error


def test_constraint_and_response_format_together_are_refused(server):
    body = {"model": "tiny", **CHAT[1], "response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "a+"}}
    r = httpx.post(server.url + CHAT[0], json=body, timeout=60)
    assert r.status_code == 400 and "one constraint" in r.json()["error"]["message"]


def test_a_regex_that_matches_nothing_ends_only_its_own_request(server):
    dead = {"model": "tiny", **TEXT[1], "max_tokens": 8, "structured_outputs": {"regex": r"[^\s\S]"}}
    plain = {"model": "tiny", **TEXT[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post(TEXT[0], json=dead)
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex"
        assert client.post(TEXT[0], json=plain).json()["choices"][0]["finish_reason"] == "length"


def test_a_compiled_constraint_is_cached(server):
    grammars = server.state.serving.grammars
    body = {"model": "tiny", **TEXT[1], "max_tokens": 20, "structured_outputs": {"regex": "(ab|cd){1,3}!"}}
    httpx.post(server.url + TEXT[0], json=body, timeout=60).raise_for_status()
    cached = len(grammars._cache)
    httpx.post(server.url + TEXT[0], json=body, timeout=60).raise_for_status()
    assert len(grammars._cache) == cached
