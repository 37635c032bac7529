"""`x-request-id` on the tiny model over a real socket: every response carries it, the client's when it is usable,
else ours; the response's own id ends with it on every API; the log lines written while the request is handled
carry it, and the JSON formatter writes each of them as one object."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from app.logs import JsonFormatter
from app.request_id import RequestIdFilter

CHAT = "/v1/chat/completions"


def chat_body(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, **extra}


@pytest.fixture
def server(make_tiny_server):
    return make_tiny_server()


def test_the_clients_id_comes_back_as_the_header_and_the_response_ids_suffix(server):
    sent = "req-2026/12.02:abc_XYZ~1"
    r = httpx.post(server.url + CHAT, json=chat_body(), headers={"x-request-id": sent})
    assert r.headers["x-request-id"] == sent and r.json()["id"] == f"chatcmpl-{sent}"
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                   headers={"x-request-id": sent})
    assert r.headers["x-request-id"] == sent and r.json()["id"] == f"cmpl-{sent}"
    r = httpx.post(server.url + "/v1/messages", json=chat_body(), headers={"x-request-id": sent})
    assert r.headers["x-request-id"] == sent and r.json()["id"] == f"msg_{sent}"
    r = httpx.post(server.url + "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 16},
                   headers={"x-request-id": sent})
    assert r.headers["x-request-id"] == sent and r.json()["id"] == f"resp_{sent}"
    with httpx.stream("POST", server.url + CHAT, json=chat_body(stream=True), headers={"x-request-id": sent}) as s:
        assert s.headers["x-request-id"] == sent
        ids = {json.loads(line[6:])["id"] for line in s.iter_lines() if line.startswith("data: {")}
    assert ids == {f"chatcmpl-{sent}"}


@pytest.mark.parametrize("sent", ["x" * 129, "has space", "tab\there", "", "caf\u00e9"])
def test_an_unusable_id_is_replaced_by_ours_never_refused(server, sent):
    r = httpx.post(server.url + CHAT, json=chat_body(), headers={"x-request-id": sent.encode("utf-8")})
    assert r.status_code == 200
    ours = r.headers["x-request-id"]
    assert ours != sent and len(ours) == 32 and int(ours, 16) >= 0
    assert r.json()["id"] == f"chatcmpl-{ours}"


def test_every_answer_carries_an_id_errors_and_probes_included(server):
    for method, path, body in [("GET", "/health", None), ("GET", "/v1/models", None), ("GET", "/nope", None),
                               ("POST", CHAT, {"model": "other", "messages": []}),
                               ("POST", CHAT, chat_body(max_tokens=-1))]:
        r = httpx.request(method, server.url + path, json=body)
        assert len(r.headers["x-request-id"]) == 32, (path, r.status_code)
    huge = httpx.post(server.url + CHAT, content=b"x" * 2_000_000, headers={"x-request-id": "big-1"})
    assert huge.status_code == 413 and huge.headers["x-request-id"] == "big-1"


def test_the_requests_log_lines_carry_its_id_one_json_object_each(server, caplog, monkeypatch):
    import app.core.engine.step as step_module

    caplog.handler.addFilter(RequestIdFilter())
    with caplog.at_level(logging.INFO):
        # ignore_eos: the tiny model samples, and an early EOS would make the 4 tokens and "length" below flaky
        httpx.post(server.url + CHAT, json=chat_body(max_tokens=4, ignore_eos=True),
                   headers={"x-request-id": "find-me-7"})
        httpx.post(server.url + CHAT, json=chat_body(model="other"), headers={"x-request-id": "find-me-8"})
        monkeypatch.setattr(step_module, "run_pass", lambda *a, **k: 1 / 0)  # a failure the serving layer logs
        httpx.post(server.url + CHAT, json=chat_body(stream=True), headers={"x-request-id": "find-me-9"})
        # an access line is written once its response is out, and the engine thread logs its error on its own
        # time: wait for all of them (on a busy machine, seconds)
        wanted = {"app.core.engine.engine", "app.openai.flow", "app.access"}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (
                len([r for r in caplog.records if r.name == "app.access"]) < 3
                or not wanted <= {r.name for r in caplog.records if getattr(r, "request_id", None) == "find-me-9"}):
            time.sleep(0.02)
    lines = [JsonFormatter().format(record) for record in caplog.records]
    records = [json.loads(line) for line in lines]
    assert all("\n" not in line for line in lines)
    access = {r["request_id"]: r for r in records if r["logger"] == "app.access"}
    ok, missing = access["find-me-7"], access["find-me-8"]
    assert ok["status"] == 200 and ok["model"] == "tiny" and ok["completion_tokens"] == 4
    assert ok["finish_reason"] == "length" and ok["prompt_tokens"] > 0 and ok["duration_s"] > 0 and ok["ttft_s"] > 0
    assert ok["path"] == CHAT and "chatcmpl-find-me-7" in ok["message"]
    assert missing["status"] == 404 and "model" not in missing
    failed = [r for r in records if r.get("request_id") == "find-me-9"]
    # the engine thread's error, the serving layer's warning and the access line
    assert {r["logger"] for r in failed} >= {"app.core.engine.engine", "app.openai.flow", "app.access"}, failed
