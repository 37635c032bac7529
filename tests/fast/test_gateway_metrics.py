"""What an inference gateway's endpoint picker scrapes from /metrics, on the tiny model over a real socket: the
queued / running / KV-usage gauges move as requests queue and run, KV usage stays within 0..1, the cache-info
labels describe the budget, and the vLLM-named aliases always read the same as our own names."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from app.core.engine.kv_budget import KVLayout
from app.metrics import parse_samples

CHAT = "/v1/chat/completions"


def body(content: str = "Which city is the capital of France?", **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 12, "ignore_eos": True, **extra}


def scrape(server) -> dict[str, float]:
    return parse_samples(httpx.get(server.url + "/metrics").text)


def labelled(samples: dict[str, float], name: str) -> list[tuple[str, float]]:
    return [(key, value) for key, value in samples.items() if key.startswith(name + "{")]


def assert_aliases_agree(m: dict[str, float]) -> None:
    """A picker left on its vLLM defaults sees exactly what our own names say."""
    assert m["vllm:num_requests_waiting"] == m["simple_serve_queue_depth"]
    assert m["vllm:num_requests_running"] == m["simple_serve_active_sequences"]
    assert m["vllm:kv_cache_usage_perc"] == m["simple_serve_kv_cache_usage_ratio"]
    assert m["vllm:prefix_cache_hits_total"] == m["simple_serve_prefix_cache_hit_tokens_total"]
    assert m["vllm:prefix_cache_queries_total"] == m["simple_serve_prefix_cache_queried_tokens_total"]
    assert [v for _, v in labelled(m, "vllm:cache_config_info")] == [1.0]
    assert (labelled(m, "vllm:cache_config_info")[0][0].removeprefix("vllm:cache_config_info")
            == labelled(m, "simple_serve_kv_cache_info")[0][0].removeprefix("simple_serve_kv_cache_info"))


def wait_for(server, condition, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = scrape(server)
        if condition(m):
            return m
        time.sleep(0.02)
    gauges = {k: v for k, v in m.items() if k.startswith("vllm:")}
    raise AssertionError(f"/metrics never reached the expected state; last: {gauges}")


@pytest.fixture
def slow_steps(monkeypatch):
    """Each forward pass takes 20 ms longer, so a 200-token stream runs long enough to be watched."""
    import app.core.engine.step as step_module

    real = step_module.run_pass
    monkeypatch.setattr(step_module, "run_pass", lambda *a, **k: (time.sleep(0.02), real(*a, **k))[1])


def stream_in_background(server, payload: dict) -> tuple[threading.Thread, list]:
    finish: list = []

    def run():
        with httpx.stream("POST", server.url + CHAT, json=payload, timeout=120) as r:
            finish.extend(line for line in r.iter_lines() if '"finish_reason":"length"' in line.replace(" ", ""))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, finish


def test_idle_server_exports_the_protocol_metrics(make_tiny_server, tiny_lm):
    server = make_tiny_server(kv_cache_bytes=8 * 2**20)
    m = scrape(server)
    assert m["simple_serve_queue_depth"] == 0 and m["simple_serve_active_sequences"] == 0
    assert m["simple_serve_kv_cache_usage_ratio"] == 0.0
    [(key, value)] = labelled(m, "simple_serve_kv_cache_info")
    layout = KVLayout.from_config(tiny_lm.model.config, tiny_lm.dtype)
    # the budget counted in 16-token prefix-cache blocks, under the label names the picker reads by default
    assert value == 1.0
    assert key == (f'simple_serve_kv_cache_info{{block_size="16",'
                   f'num_gpu_blocks="{8 * 2**20 // layout.bytes_for(16)}"}}')
    assert_aliases_agree(m)


@pytest.mark.full
def test_gauges_follow_requests_that_queue_then_run(make_tiny_server, slow_steps):
    """One decode slot, two long streams: one runs and one queues, KV usage is the reserved share of the budget,
    and everything returns to zero when both are done."""
    server = make_tiny_server(max_active=1, prefix_cache_bytes=0, kv_cache_bytes=8 * 2**20)
    runs = [stream_in_background(server, body(max_tokens=60, stream=True)) for _ in range(2)]
    busy = wait_for(server, lambda m: m["simple_serve_active_sequences"] == 1 and m["simple_serve_queue_depth"] == 1)
    assert_aliases_agree(busy)
    usage = busy["simple_serve_kv_cache_usage_ratio"]
    assert 0 < usage <= 1
    reserved, budget = busy["simple_serve_kv_cache_reserved_bytes"], busy["simple_serve_kv_cache_budget_bytes"]
    assert usage == pytest.approx(reserved / budget)
    for thread, _ in runs:
        thread.join(timeout=120)
    assert [len(finish) for _, finish in runs] == [1, 1], "both streams ran to max_tokens"
    idle = wait_for(server, lambda m: m["simple_serve_active_sequences"] == 0)
    assert idle["simple_serve_queue_depth"] == 0 and idle["simple_serve_kv_cache_usage_ratio"] == 0.0
    assert_aliases_agree(idle)


@pytest.mark.full
def test_a_full_kv_budget_reads_near_one_and_the_next_request_queues(make_tiny_server, slow_steps, tiny_lm):
    """Slots are free but the KV budget is not: the picker sees usage near 1 and a queue, the signal to go
    elsewhere."""
    layout = KVLayout.from_config(tiny_lm.model.config, tiny_lm.dtype)
    prompt_tokens = len(tiny_lm.encode_chat(body()["messages"]))
    one_request = layout.bytes_for(prompt_tokens + 200)
    server = make_tiny_server(max_active=4, prefix_cache_bytes=0, kv_cache_bytes=int(one_request * 1.25))
    runs = [stream_in_background(server, body(max_tokens=200, stream=True)) for _ in range(2)]
    full = wait_for(server, lambda m: m["simple_serve_active_sequences"] == 1 and m["simple_serve_queue_depth"] == 1)
    assert full["simple_serve_kv_cache_usage_ratio"] == pytest.approx(1 / 1.25, abs=0.02)
    assert full["vllm:kv_cache_usage_perc"] == full["simple_serve_kv_cache_usage_ratio"]
    for thread, _ in runs:
        thread.join(timeout=120)


def test_prefix_cache_counters_reach_the_aliases(make_tiny_server):
    server = make_tiny_server()
    long_prompt = "You are a careful assistant who answers in one short sentence. " * 2
    for _ in range(2):
        assert httpx.post(server.url + CHAT, json=body(long_prompt, max_tokens=2), timeout=60).status_code == 200
    m = scrape(server)
    assert m["vllm:prefix_cache_hits_total"] > 0, "the second request reused the first one's prefix"
    assert m["vllm:prefix_cache_hits_total"] <= m["vllm:prefix_cache_queries_total"]
    # the prefix cache holds KV, but a reservation would evict it: it does not count as used
    assert m["simple_serve_prefix_cache_bytes"] > 0 and m["simple_serve_kv_cache_usage_ratio"] == 0.0
    assert_aliases_agree(m)
