"""Deadlines on the tiny model over a real socket: `x-request-timeout` (and REQUEST_TIMEOUT_S) end a long generation
at the step where time runs out, with what was made and finish reason "timeout", streamed and not, and free its slot
at once; QUEUE_TIMEOUT_S answers a request stuck behind full slots with a 503 and Retry-After, and it never starts.
Each pass is slowed to 50 ms, so 200 tokens would take about 10 s."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from app.metrics import parse_samples

CHAT = "/v1/chat/completions"
STEP_S = 0.05


def chat_body(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about Paris"}], "temperature": 0,
            "max_tokens": 200, "ignore_eos": True, **extra}


@pytest.fixture
def slow_steps(monkeypatch):
    import app.core.engine.step as step_module

    real = step_module.run_pass
    monkeypatch.setattr(step_module, "run_pass", lambda *a, **k: (time.sleep(STEP_S), real(*a, **k))[1])


def metrics(server) -> dict[str, float]:
    return parse_samples(httpx.get(server.url + "/metrics").text)


def sse_payloads(response) -> list:
    return [json.loads(line[6:]) if line[6:].startswith("{") else line[6:]
            for line in response.iter_lines() if line.startswith("data: ")]


def test_an_invalid_request_timeout_header_is_a_400_naming_it(make_tiny_server):
    server = make_tiny_server()
    for value in ("soon", "0", "-3", "nan", "inf", ""):
        r = httpx.post(server.url + CHAT, json=chat_body(max_tokens=2), headers={"x-request-timeout": value})
        assert r.status_code == 400, (value, r.text)
        assert r.json()["error"]["param"] == "x-request-timeout"
    ok = httpx.post(server.url + CHAT, json=chat_body(max_tokens=2), headers={"x-request-timeout": "30"})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.full
def test_a_one_second_header_ends_a_ten_second_answer_with_what_was_made(make_tiny_server, slow_steps):
    server = make_tiny_server()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    started = time.perf_counter()
    body = chat_body()
    extra = {"ignore_eos": body.pop("ignore_eos")}
    answer = client.chat.completions.create(**body, extra_body=extra,
                                            extra_headers={"x-request-timeout": "1"})
    elapsed = time.perf_counter() - started
    assert elapsed < 2.0, f"took {elapsed:.2f} s"
    choice = answer.choices[0]
    assert choice.finish_reason == "timeout"  # the openai SDK takes the reason as it comes
    assert 0 < answer.usage.completion_tokens < 200 and choice.message.content
    m = metrics(server)
    assert m["simple_serve_active_sequences"] == 0 and m["simple_serve_kv_cache_usage_ratio"] == 0
    assert m['simple_serve_deadlines_exceeded_total{stage="run"}'] == 1
    assert m['simple_serve_generations_finished_total{reason="timeout"}'] == 1


@pytest.mark.full
def test_a_stream_past_its_deadline_ends_cleanly_with_timeout_then_done(make_tiny_server, slow_steps):
    server = make_tiny_server(request_timeout_s=1.0)  # the server's limit; a longer header cannot extend it
    started = time.perf_counter()
    with httpx.stream("POST", server.url + CHAT, json=chat_body(stream=True, stream_options={"include_usage": True}),
                      headers={"x-request-timeout": "60"}) as r:
        assert r.status_code == 200
        chunks = sse_payloads(r)
    elapsed = time.perf_counter() - started
    assert elapsed < 2.0, f"took {elapsed:.2f} s"
    assert chunks[-1] == "[DONE]"
    reasons = [c["choices"][0]["finish_reason"] for c in chunks[:-1] if c["choices"]]
    assert reasons[-1] == "timeout" and set(reasons[:-1]) == {None}
    assert 0 < chunks[-2]["usage"]["completion_tokens"] < 200
    assert metrics(server)["simple_serve_active_sequences"] == 0
    # the slot is free: the next request runs at once
    assert httpx.post(server.url + CHAT, json=chat_body(max_tokens=3)).json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.full
def test_a_request_queued_past_its_limit_gets_a_503_with_retry_after_and_never_starts(make_tiny_server, slow_steps):
    server = make_tiny_server(max_active=1, queue_timeout_s=1.0)
    holder = threading.Thread(target=httpx.post, args=(server.url + CHAT,), kwargs={"json": chat_body(max_tokens=80),
                                                                                    "timeout": 60})
    holder.start()
    deadline = time.monotonic() + 30
    while metrics(server)["simple_serve_active_sequences"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    answers = {}
    for name, path, body in [("chat", CHAT, chat_body(max_tokens=5)), ("stream", CHAT, chat_body(stream=True)),
                             ("messages", "/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": [
                                 {"role": "user", "content": "hi"}]})]:
        started = time.perf_counter()
        answers[name] = (httpx.post(server.url + path, json=body, timeout=30), time.perf_counter() - started)
    for name, (r, elapsed) in answers.items():
        assert elapsed < 2.0, f"{name} took {elapsed:.2f} s"
        assert r.headers["retry-after"] == "1", name
    for name in ("chat", "stream"):  # OpenAI's shape; a stream's 200 waited for its slot, so it is an HTTP error
        r = answers[name][0]
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout", r.text
    r = answers["messages"][0]
    assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error", r.text
    holder.join(60)
    m = metrics(server)
    assert m['simple_serve_deadlines_exceeded_total{stage="queue"}'] == 3
    assert m["simple_serve_prompt_tokens_total"] > 0 and m["simple_serve_queue_depth"] == 0
    assert m['simple_serve_generations_finished_total{reason="length"}'] == 1  # the holder: the others never started
