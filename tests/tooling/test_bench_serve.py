"""Tests for benchmarks.serve against a tiny fake OpenAI-compatible server (offline, ~1 s)."""

import argparse
import asyncio
import json
import socket
import statistics
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from benchmarks.serve import add_arguments, build_prompt, estimate_tokens, parse_sse_line, percentile, run

CHUNKS = 5  # content chunks per streamed reply
TOKENS_PER_CHUNK = 2  # a chunk may hold several tokens; the bench must trust usage, not chunk counts
COMPLETION_TOKENS = CHUNKS * TOKENS_PER_CHUNK
PROMPT_TOKENS = 123
DELAY = 0.01  # seconds before each content chunk


def _fake_app(state: dict) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        state["n"] += 1
        n = state["n"]
        state["bodies"].append(body)
        state["auth"].append(request.headers.get("authorization"))
        failure = state["fail"].get(n)  # requests are numbered in arrival order
        if failure == "http":
            return JSONResponse({"error": {"message": f"boom {n}"}}, status_code=500)
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS,
                 "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS}
        state["inflight"] += 1
        state["max_inflight"] = max(state["max_inflight"], state["inflight"])
        if not body.get("stream"):
            await asyncio.sleep(CHUNKS * DELAY)
            state["inflight"] -= 1
            message = {"role": "assistant", "content": "ab " * COMPLETION_TOKENS}
            return {"id": "x", "object": "chat.completion", "model": body["model"], "usage": usage,
                    "choices": [{"index": 0, "message": message, "finish_reason": "length"}]}

        def chunk(delta: dict) -> dict:
            return {"data": json.dumps({"id": "x", "object": "chat.completion.chunk",
                                        "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})}

        async def events():
            try:
                yield ServerSentEvent(comment="keep-alive")  # must be ignored
                yield chunk({"role": "assistant", "content": ""})  # empty: not the first token
                # a long max_tokens (the burst scenario's background streams) streams for as long as it asks
                chunks = body["max_tokens"] // TOKENS_PER_CHUNK if body.get("max_tokens", 0) >= 200 else CHUNKS
                for i in range(chunks):
                    await asyncio.sleep(DELAY)
                    if failure == "sse" and i == 2:
                        yield {"event": "error", "data": json.dumps({"error": {"message": "engine died"}})}
                        return
                    yield chunk({"content": "ab " * TOKENS_PER_CHUNK})
                yield {"data": json.dumps({"id": "x", "choices": [], "usage": usage})}
                yield {"data": "[DONE]"}
            finally:
                state["inflight"] -= 1

        return EventSourceResponse(events())

    return app


@pytest.fixture(scope="module")
def server():
    state: dict = {}
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # the OS picks a free port; uvicorn serves on this very socket
    srv = uvicorn.Server(uvicorn.Config(_fake_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not srv.started:
        assert time.time() < deadline, "fake server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", state
    srv.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def fake(server):
    url, state = server
    state.update(n=0, bodies=[], auth=[], fail={}, inflight=0, max_inflight=0)
    return url, state


def _bench(url: str, tmp_path, *flags: str) -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)  # exercise the real CLI flags, as `python -m benchmarks serve` would
    args = parser.parse_args(["--url", url, "--model", "fake-model", "--out", str(tmp_path / "out.json"), *flags])
    return run(args)


def test_streaming_metrics_errors_and_request_shape(fake, tmp_path, capsys):
    url, state = fake
    state["fail"] = {3: "http", 6: "sse"}
    res = _bench(url, tmp_path, "--stream", "--concurrency", "3", "--requests", "8", "--prompt-len", "64",
                 "--max-tokens", str(COMPLETION_TOKENS), "--api-key", "sk-test")

    assert res["requests"] == {"total": 8, "succeeded": 6, "failed": 2}
    assert res["errors"]["count"] == 2
    assert any("HTTP 500" in m and "boom" in m for m in res["errors"]["messages"])
    assert any("SSE error" in m and "engine died" in m for m in res["errors"]["messages"])
    assert res["completion_tokens_total"] == 6 * COMPLETION_TOKENS  # from usage, not the 5 chunks
    assert res["prompt_tokens_mean"] == PROMPT_TOKENS

    wall = res["wall_time_s"]
    assert DELAY * 0.9 <= res["ttft_s"]["p50"] <= res["ttft_s"]["p99"] < wall
    assert res["ttft_s"]["p99"] < res["latency_s"]["p99"]
    assert res["chunk_gap_s"]["n"] == 6 * (CHUNKS - 1) and res["chunk_gap_s"]["p50"] >= DELAY * 0.9
    # Per-token ITL spreads the (CHUNKS-1) gaps over (COMPLETION_TOKENS-1) tokens, so it is smaller.
    assert res["itl_per_token_s"]["p50"] < res["chunk_gap_s"]["p50"]
    assert res["itl_per_token_s"]["p50"] >= (CHUNKS - 1) * DELAY * 0.9 / (COMPLETION_TOKENS - 1)
    assert res["output_tokens_per_s"]["aggregate"] == pytest.approx(res["completion_tokens_total"] / wall)
    assert res["request_throughput_rps"] == pytest.approx(6 / wall)
    assert 0 < res["output_tokens_per_s"]["per_stream"]["p50"] < COMPLETION_TOKENS / (CHUNKS * DELAY * 0.9)

    assert state["n"] == 8 and 1 < state["max_inflight"] <= 3
    body = state["bodies"][0]
    assert body["model"] == "fake-model" and body["temperature"] == 0 and body["max_tokens"] == COMPLETION_TOKENS
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True
    assert set(state["auth"]) == {"Bearer sk-test"}
    assert len({b["messages"][0]["content"] for b in state["bodies"]}) == 8  # a distinct prompt per request

    assert json.loads((tmp_path / "out.json").read_text()) == res
    assert res["config"] == {"url": url, "model": "fake-model", "concurrency": 3, "requests": 8, "prompt_len": 64,
                             "max_tokens": COMPLETION_TOKENS, "stream": True, "ignore_eos": True, "seed": 0,
                             "temperature": "0", "mixed": False}
    table = capsys.readouterr().out
    assert "requests ok / failed" in table and "6 / 2" in table and "engine died" in table


def test_non_streaming_mode(fake, tmp_path):
    url, state = fake
    res = _bench(url + "/v1/", tmp_path, "--concurrency", "2", "--requests", "4", "--no-ignore-eos",
                 "--temperature", "none")

    assert res["requests"] == {"total": 4, "succeeded": 4, "failed": 0}
    assert res["completion_tokens_total"] == 4 * COMPLETION_TOKENS
    assert res["ttft_s"]["n"] == 0 and res["ttft_s"]["p50"] is None  # no TTFT without streaming
    assert res["latency_s"]["p50"] >= CHUNKS * DELAY * 0.9
    assert res["output_tokens_per_s"]["aggregate"] == pytest.approx(4 * COMPLETION_TOKENS / res["wall_time_s"])
    body = state["bodies"][0]
    assert body["stream"] is False and "stream_options" not in body and "ignore_eos" not in body
    assert "temperature" not in body  # --temperature none: the server's model defaults decide
    assert state["auth"] == [None] * 4


def test_unreachable_server_is_counted_not_raised(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens here now
    res = _bench(f"http://127.0.0.1:{port}", tmp_path, "--stream", "--requests", "3", "--timeout", "5")
    assert res["requests"] == {"total": 3, "succeeded": 0, "failed": 3}
    assert res["errors"]["messages"][0].startswith("ConnectError")
    assert res["completion_tokens_total"] == 0 and res["output_tokens_per_s"]["aggregate"] == 0


def test_prompt_builder_is_seeded_mixed_and_sized():
    a = build_prompt(200, seed=7)
    assert a == build_prompt(200, seed=7)
    assert a != build_prompt(200, seed=8)
    assert any(c.isascii() and c.isalpha() for c in a)
    assert any("\u4e00" <= c <= "\u9fff" for c in a)
    assert 200 <= estimate_tokens(a) < 260  # overshoots by at most one passage
    words = build_prompt(50, seed=1, count_tokens=lambda t: len(t.split()))  # a custom tokenizer is honoured
    assert len(words.split()) >= 50
    assert estimate_tokens("abcd" * 10) == 10 and estimate_tokens("中文" * 3) == pytest.approx(4)


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([7.0], 50) == 7.0 and percentile([7.0], 99) == 7.0
    assert percentile([4, 1, 3, 2], 50) == 2.5  # unsorted input, interpolated
    assert percentile([1, 2, 3], 0) == 1 and percentile([1, 2, 3], 100) == 3
    data = [0.3, 1.7, 2.2, 9.0, 4.4, 5.1, 0.9]
    assert percentile(data, 99) == pytest.approx(statistics.quantiles(data, n=100, method="inclusive")[98])


def test_parse_sse_line():
    assert parse_sse_line(": ping - 2024-01-01") is None
    assert parse_sse_line("") is None
    assert parse_sse_line("id: 3") is None
    assert parse_sse_line("event: error") == ("event", "error")
    assert parse_sse_line('data: {"a": 1}') == ("data", '{"a": 1}')
    assert parse_sse_line("data:[DONE]") == ("data", "[DONE]")


def test_mixed_workload_sends_the_same_mixed_prompts_and_answer_lengths_for_a_seed(fake, tmp_path):
    url, state = fake
    res = _bench(url, tmp_path, "--stream", "--mixed", "--requests", "6", "--concurrency", "4", "--seed", "3")
    first = [(len(b["messages"][0]["content"]), b["max_tokens"]) for b in state["bodies"]]
    state["bodies"].clear()
    _bench(url, tmp_path, "--stream", "--mixed", "--requests", "6", "--concurrency", "4", "--seed", "3")
    assert sorted(first) == sorted((len(b["messages"][0]["content"]), b["max_tokens"]) for b in state["bodies"])
    answers = [n for _, n in first]
    assert all(16 <= n <= 600 for n in answers) and len(set(answers)) > 1  # mixed, within the bounds
    prompts = [estimate_tokens(b["messages"][0]["content"]) for b in state["bodies"]]
    assert all(100 <= p < 1700 for p in prompts) and max(prompts) - min(prompts) > 100
    assert res["config"]["mixed"] is True and res["ttft_s"]["p90"] is not None
    assert state["max_inflight"] <= 4
