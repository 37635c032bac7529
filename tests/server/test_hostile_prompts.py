"""Issue 34's small bodies that were 500s (findings 1 and 3) against one live server process: each is a 4xx, the
server serves on, and its log stays small, with no traceback and no line a request wrote itself."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import serve_process
from test_prompt_errors import HI, deep_chat, deep_messages, deep_responses, nested

pytestmark = pytest.mark.server
KEY = "sk-test"
FORGED = "2026-12-02 10:00:00,000 INFO app.access: - POST /v1/chat/completions 200"


def responses(*items, **extra) -> dict:
    return {"model": "tiny", "max_output_tokens": 1, "input": list(items) or "hi", **extra}


# (name, path, body: a dict, or the raw bytes for a body no JSON encoder writes)
REPROS = [
    ("chat: tool call arguments nested 600 deep", "/v1/chat/completions", deep_chat()),
    ("messages: tool_use.input nested 600 deep", "/v1/messages", deep_messages()),
    ("responses: function_call arguments nested 600 deep", "/v1/responses", deep_responses()),
    ("responses: text.format nested 600 deep", "/v1/responses", responses(text={"format": {
        "type": "json_schema", "name": "x", "schema": nested(600)}})),
    ("responses: reasoning content 5", "/v1/responses", responses({"type": "reasoning", "content": 5}, HI)),
    ("responses: reasoning text 5", "/v1/responses", responses({"type": "reasoning", "content": [{"text": 5}]}, HI)),
    ("responses: input_text 5", "/v1/responses", responses(
        {"role": "user", "content": [{"type": "input_text", "text": 5}]})),
    ("responses: input_text ['a']", "/v1/responses", responses(
        {"role": "user", "content": [{"type": "input_text", "text": ["a"]}]})),
    ("responses: function_call_output object", "/v1/responses", responses(
        HI, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": {"a": 1}})),
    ("responses: text.format 'json'", "/v1/responses", responses(text={"format": "json"})),
    ("chat: chat_template_kwargs self", "/v1/chat/completions", {
        "model": "tiny", "max_tokens": 1, "messages": [HI], "chat_template_kwargs": {"self": 1}}),
    ("responses: chat_template_kwargs self", "/v1/responses", responses(chat_template_kwargs={"self": 1})),
    ("responses, streamed: NaN in text.format", "/v1/responses", json.dumps(responses(
        stream=True, text={"format": {"type": "text", "x": float("nan")}})).encode()),
]


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("hostile-prompts") / "serve.log"
    with serve_process(tiny_dir, log, env={"SERVED_MODEL_NAME": "tiny", "API_KEY": KEY}, clean_log=False) as url:
        yield url, log


def test_each_repro_is_a_4xx_and_the_log_stays_small(server):
    url, log = server
    before = log.stat().st_size
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        for name, path, body in REPROS:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = client.post(path, content=content)
            assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
            assert r.headers["content-type"] == "application/json", (name, r.text)  # not a stream that failed
            error = r.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error", (name, error)
        # a URL path with a newline: its access line must not become two
        assert client.get("/nothing%0a" + FORGED.replace(" ", "%20")).status_code == 404
        assert client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                         "messages": [HI]}).status_code == 200
    text = log.read_text()
    grew = log.stat().st_size - before
    assert grew < 16_000, f"{len(REPROS)} small requests wrote {grew} bytes of log"
    assert "Traceback" not in text, text[-4000:]
    assert not [line for line in text.splitlines() if line.startswith(FORGED)], "a forged line"
    assert "/nothing\\n2026-12-02" in text
