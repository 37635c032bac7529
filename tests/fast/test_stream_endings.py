"""One stream loop for every generating API (issue 45, finding 11): a deadline, an engine failure and a client that
leaves give chat completions, completions, Responses and Messages each its documented ending (docs/api.md,
docs/operations.md), and they come from the same code, `app/openai/flow.py`: the ending each API declares
(`done_after`) is what it sends, and the shared loop's warning is what each failure logs."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from app.anthropic.serving import MessagesApi
from app.metrics import parse_samples
from app.openai.flow import FINISHED, FAILED
from app.openai.responses.serving import ResponsesApi
from app.openai.serving import ChatApi, CompletionsApi

pytestmark = pytest.mark.full  # slowed steps, four APIs, three endings: ~10 s
STEP_S = 0.05
QUESTION = "Tell me about Paris"
APIS = {
    "chat": ("/v1/chat/completions", ChatApi, {"messages": [{"role": "user", "content": QUESTION}],
                                               "max_tokens": 200}),
    "completions": ("/v1/completions", CompletionsApi, {"prompt": QUESTION, "max_tokens": 200}),
    "responses": ("/v1/responses", ResponsesApi, {"input": QUESTION, "max_output_tokens": 200}),
    "messages": ("/v1/messages", MessagesApi, {"messages": [{"role": "user", "content": QUESTION}],
                                               "max_tokens": 200}),
}


def stream(server, api: str, headers: dict | None = None, read: int | None = None) -> list[tuple[str | None, str]]:
    """(event name, data) of each SSE event, all of them or the first `read`."""
    path, _, body = APIS[api]
    events, name = [], None
    with httpx.stream("POST", server.url + path, headers=headers or {}, timeout=30,
                      json={"model": "tiny", "temperature": 0, "ignore_eos": True, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, line[6:]))
                name = None
                if read is not None and len(events) >= read:
                    break
    return events


def ends_with_done(events) -> bool:
    return events[-1][1] == "[DONE]"


def payloads(events) -> list[dict]:
    return [json.loads(data) for _, data in events if data != "[DONE]"]


def metrics(server) -> dict[str, float]:
    return parse_samples(httpx.get(server.url + "/metrics").text)


@pytest.fixture
def slow_steps(monkeypatch):
    import app.core.engine.step as step_module

    real = step_module.run_pass
    monkeypatch.setattr(step_module, "run_pass", lambda *a, **k: (time.sleep(STEP_S), real(*a, **k))[1])


@pytest.mark.parametrize("api", APIS)
def test_a_deadline_ends_each_api_as_documented(make_tiny_server, slow_steps, api):
    server = make_tiny_server()
    events = stream(server, api, headers={"x-request-timeout": "0.5"})
    assert ends_with_done(events) == (FINISHED in APIS[api][1].done_after)
    last = payloads(events)[-1]
    if api == "chat":
        assert [c for p in payloads(events) for c in p["choices"]][-1]["finish_reason"] == "timeout"
    elif api == "completions":
        assert [c for p in payloads(events) for c in p["choices"]][-1]["finish_reason"] == "timeout"
    elif api == "responses":
        assert last["type"] == "response.incomplete"
        assert last["response"]["incomplete_details"] == {"reason": "timeout"}
    else:
        assert last["type"] == "message_stop"
        assert payloads(events)[-2]["delta"]["stop_reason"] == "max_tokens"
    assert metrics(server)['simple_serve_generations_finished_total{reason="timeout"}'] == 1


@pytest.mark.parametrize("api", APIS)
def test_an_engine_failure_ends_each_api_as_documented(make_tiny_server, monkeypatch, caplog, api):
    import app.core.engine.step as step_module

    server = make_tiny_server()
    calls = {"n": 0}
    real = step_module.run_pass

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(step_module, "run_pass", flaky)
    with caplog.at_level(logging.WARNING, logger="app.openai.flow"):
        events = stream(server, api)
    assert ends_with_done(events) == (FAILED in APIS[api][1].done_after)
    error = [(name, p) for (name, data), p in zip([e for e in events if e[1] != "[DONE]"], payloads(events))][-1]
    if api == "messages":
        assert error[0] == "error" and error[1]["type"] == "error"
        assert "simulated device failure" in error[1]["error"]["message"]
    elif api == "responses":
        assert error[1]["type"] == "error" and "simulated device failure" in error[1]["message"]
    else:
        assert "simulated device failure" in error[1]["error"]["message"]
    assert any("simulated device failure" in r.getMessage() for r in caplog.records if r.name == "app.openai.flow")
    assert metrics(server)[f'simple_serve_requests_total{{endpoint="{APIS[api][0]}",status="500"}}'] == 1


@pytest.mark.parametrize("api", APIS)
def test_a_client_that_leaves_cancels_its_generation_on_each_api(make_tiny_server, slow_steps, api):
    server = make_tiny_server()
    stream(server, api, read=2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and metrics(server).get("simple_serve_cancellations_total", 0) < 1:
        time.sleep(0.05)
    m = metrics(server)
    assert m["simple_serve_cancellations_total"] == 1 and m["simple_serve_active_sequences"] == 0
