"""`/health/generate` on the tiny model over a real socket: 200 while the engine makes progress (idle: it proves it
with one token), 503 while a forward pass is stuck (a test hook holds it) and `/health` stays 200, 200 again once
the pass goes on; under 8 decoding streams it answers at once from the steps' progress, without queueing."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

CHAT = "/v1/chat/completions"


def chat_body(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "temperature": 0,
            "max_tokens": 20, "ignore_eos": True, **extra}


@pytest.fixture
def stall(monkeypatch):
    """While `stall` (an Event) is set, the next forward pass waits until it is cleared: a stuck device."""
    import app.core.engine.step as step_module

    real, held = step_module.run_pass, threading.Event()

    def run_pass(*a, **k):
        while held.is_set():
            time.sleep(0.01)
        return real(*a, **k)

    monkeypatch.setattr(step_module, "run_pass", run_pass)
    yield held
    held.clear()


def probe(server) -> httpx.Response:
    return httpx.get(server.url + "/health/generate", timeout=10)


def test_an_idle_engine_proves_itself_with_one_token(make_tiny_server):
    server = make_tiny_server(health_generate_timeout_s=0.3)
    time.sleep(0.4)  # the warm-up's step is older than the bound: only a generation now can prove it
    r = probe(server)
    assert r.status_code == 200 and r.json() == {"status": "ok", "generated": True}, r.text
    r = probe(server)
    assert r.status_code == 200  # that generation's step is recent


@pytest.mark.full
def test_the_probes_own_generation_is_not_counted_as_traffic(make_tiny_server):
    from app.metrics import parse_samples

    server = make_tiny_server(health_generate_timeout_s=0.2)

    def traffic() -> dict[str, float]:
        samples = parse_samples(httpx.get(server.url + "/metrics").text)
        return {name: samples.get(name, 0.0) for name in (
            "simple_serve_time_to_first_token_seconds_count", "simple_serve_generation_duration_seconds_count",
            'simple_serve_generations_finished_total{reason="length"}', "simple_serve_completion_tokens_total",
            "simple_serve_prompt_tokens_total", 'simple_serve_lora_requests_total{adapter=""}',
            'simple_serve_lora_generated_tokens_total{adapter=""}', "simple_serve_prefix_cache_queried_tokens_total")}

    time.sleep(0.3)  # past the bound: the probe must generate
    assert probe(server).json() == {"status": "ok", "generated": True}
    assert set(traffic().values()) == {0.0}  # nor the warm-up: an idle server has served nobody
    r = httpx.post(server.url + CHAT, json=chat_body(max_tokens=3), timeout=30)
    assert r.status_code == 200
    counted = traffic()
    assert counted["simple_serve_completion_tokens_total"] == 3
    assert counted["simple_serve_time_to_first_token_seconds_count"] == 1
    assert counted['simple_serve_generations_finished_total{reason="length"}'] == 1
    assert counted["simple_serve_prompt_tokens_total"] == r.json()["usage"]["prompt_tokens"]


@pytest.mark.full
def test_a_stalled_engine_turns_the_probe_503_while_health_stays_200(make_tiny_server, stall):
    server = make_tiny_server(health_generate_timeout_s=1.0)
    assert probe(server).status_code == 200
    stall.set()
    answers: list = []
    request = threading.Thread(target=lambda: answers.append(httpx.post(server.url + CHAT, json=chat_body(),
                                                                        timeout=60)))
    request.start()
    time.sleep(1.3)
    r = probe(server)
    assert r.status_code == 503 and r.json()["status"] == "stalled", r.text
    assert httpx.get(server.url + "/health").status_code == 200
    stall.clear()
    request.join(30)
    assert answers[0].status_code == 200
    assert probe(server).status_code == 200


@pytest.mark.full
def test_the_probe_answers_at_once_while_eight_streams_decode(make_tiny_server, monkeypatch):
    import app.core.engine.step as step_module

    real = step_module.run_pass
    monkeypatch.setattr(step_module, "run_pass", lambda *a, **k: (time.sleep(0.05), real(*a, **k))[1])
    server = make_tiny_server(max_active=8, health_generate_timeout_s=5.0)
    streams = [threading.Thread(target=httpx.post, args=(server.url + CHAT,),
                                kwargs={"json": chat_body(max_tokens=100), "timeout": 60}) for _ in range(8)]
    for thread in streams:
        thread.start()
    time.sleep(1.0)
    waits = []
    for _ in range(5):
        started = time.perf_counter()
        r = probe(server)
        waits.append(time.perf_counter() - started)
        assert r.status_code == 200 and "generated" not in r.json(), r.text  # the steps were the proof
        time.sleep(0.1)
    assert max(waits) < 1.0, waits
    for thread in streams:
        thread.join(60)
