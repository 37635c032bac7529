"""Hostile and broken requests against a live server, side by side with innocent streams: one request can hurt only
itself. The innocent streams' text equals their solo run, no hostile body gets a 5xx or a torn stream, and `/health`
keeps answering within 100 ms throughout (probed from a thread of its own; the server is a process of its own, so
the test's clients do not share its interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import serve_process

pytestmark = [pytest.mark.server, pytest.mark.alone]
CHAT = "/v1/chat/completions"
HEALTH_BOUND_S = 0.1


def schema_body(schema: dict, **extra) -> dict:
    return {"messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, **extra}


def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


DEAD_END = {"type": "string", "pattern": "[^\\s\\S]"}
# Passes the static limits, yet would take seconds and over 1 GiB to compile on the tiny vocabulary: the deadline (1 s
# here) or the memory limit stops it.
SLOW = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
                  for i in range(60)]}
# (name, body, the statuses it may get, the error code a 4xx must carry)
HOSTILE = [
    ("dead end", schema_body(DEAD_END), {400}, "grammar_dead_end"),
    ("dead end, streamed", schema_body(DEAD_END, stream=True), {200}, "grammar_dead_end"),
    ("slow to compile", schema_body(SLOW), {400}, "grammar_too_complex"),
    ("slow to compile, again", schema_body({**SLOW, "title": "again"}), {400, 429}, None),
    ("nested 600 deep", schema_body(nested_arrays(600)), {400}, None),
    ("nested repetitions", schema_body({"type": "string", "pattern": "((a{0,30}){0,30}){0,30}"}), {400},
     "grammar_too_complex"),
    ("(a|b){0,20000}", schema_body({"type": "string", "pattern": "(a|b){0,20000}"}), {400}, "grammar_too_complex"),
    ("a format given as a list", schema_body({"type": "string", "format": ["email"]}), {400}, None),
    ("a regex bound of 5,000 digits", {"messages": [{"role": "user", "content": "hi"}],
                                       "guided_regex": "a{" + "9" * 5000 + "}"}, {400}, "grammar_too_complex"),
    ("huge n", {"messages": [{"role": "user", "content": "hi"}], "n": 100000}, {400}, None),
    ("huge top_logprobs", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 10**6},
     {400}, None),
    ("huge inspect.top", {"messages": [{"role": "user", "content": "hi"}], "inspect": {"top": 10**6}}, {400}, None),
    ("max_tokens past the context", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, {400},
     None),
]
INNOCENT = [{"messages": [{"role": "user", "content": "Tell me about Paris."}], "max_tokens": 120,
             "temperature": 0, "ignore_eos": True, "stream": True},
            {"messages": [{"role": "user", "content": "def reverse(s):"}], "max_tokens": 120, "temperature": 1.0,
             "seed": 11, "ignore_eos": True, "stream": True}]


PROBE = """
import pathlib, sys, time, httpx
url, out, stop = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
with httpx.Client(timeout=5) as client, out.open("w") as log:
    while not stop.exists():
        started = time.perf_counter()
        status = client.get(url + "/health").status_code
        print(status, time.perf_counter() - started, file=log, flush=True)
        time.sleep(0.02)
"""


class HealthProbe:
    """GET /health every 20 ms from a process of its own: the test's busy client threads share nothing with it."""

    def __init__(self, url: str, folder):
        self.out, self.stop = folder / "health.txt", folder / "stop"
        self.proc = subprocess.Popen([sys.executable, "-c", PROBE, url, str(self.out), str(self.stop)])

    def latencies(self) -> list[float]:
        self.stop.touch()
        assert self.proc.wait(timeout=30) == 0
        rows = [line.split() for line in self.out.read_text().splitlines()]
        assert all(status == "200" for status, _ in rows)
        return sorted(float(seconds) for _, seconds in rows)


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("adversarial") / "serve.log"
    env = {"GRAMMAR_COMPILE_TIMEOUT_S": "1", "GRAMMAR_COMPILE_QUEUE": "4", "SERVED_MODEL_NAME": "tiny",
           "GRAMMAR_COMPILE_PER_CLIENT": "8"}  # every hostile body comes from this one client
    with serve_process(tiny_dir, log, env=env) as url:
        yield url


def stream_text(url: str, body: dict) -> str:
    with httpx.stream("POST", url + CHAT, json={"model": "tiny", **body}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert not any("error" in c for c in chunks), chunks[-1]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)


def hostile(url: str, name: str, body: dict, statuses: set[int], code: str | None) -> str:
    body = {"model": "tiny", **body}
    if body.get("stream"):
        with httpx.stream("POST", url + CHAT, json=body, timeout=120) as r:
            assert r.status_code in statuses, (name, r.status_code)
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]", name  # never a torn stream
        error = json.loads(lines[-2]).get("error")
        assert error is not None and (code is None or error["code"] == code), (name, error)
        return name
    r = httpx.post(url + CHAT, json=body, timeout=120)
    assert r.status_code in statuses, (name, r.status_code, r.text)
    error = r.json()["error"]
    assert error["message"] and (code is None or r.status_code != 400 or error["code"] == code), (name, error)
    return name


def leave_early(url: str, stage: str) -> str:
    """A client that goes away: mid-stream, right after sending, while its grammar compiles, or while queued."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "ignore_eos": True}
    if stage == "mid-stream":
        with httpx.stream("POST", url + CHAT, json={**body, "stream": True}, timeout=30) as r:
            next(r.iter_lines())
    else:
        if stage == "compiling":
            body = {**body, **schema_body({**SLOW, "title": "leaves"})}
        try:
            httpx.post(url + CHAT, json=body, timeout=0.05 if stage == "after sending" else 0.3)
        except httpx.TimeoutException:
            pass
    return stage


def test_hostile_requests_hurt_only_themselves(server, tmp_path):
    solo = [stream_text(server, body) for body in INNOCENT]
    probe = HealthProbe(server, tmp_path)
    time.sleep(1)  # its interpreter has started
    try:
        with ThreadPoolExecutor(16) as pool:
            innocent = [pool.submit(stream_text, server, body) for body in INNOCENT]
            time.sleep(0.2)  # the innocent streams are decoding when the hostile ones arrive
            attacks = [pool.submit(hostile, server, *case) for case in HOSTILE]
            attacks += [pool.submit(leave_early, server, stage)
                        for stage in ("mid-stream", "after sending", "compiling", "mid-stream")]
            together = [f.result() for f in innocent]
            for attack in attacks:
                attack.result()
    finally:
        latencies = probe.latencies()
    assert together == solo and all(len(text) > 20 for text in solo)
    assert len(latencies) > 20
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(f"/health under attack: {len(latencies)} probes, p99 {p99 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms")
    assert p99 < HEALTH_BOUND_S, f"/health p99 {p99 * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms"
    metrics = httpx.get(server + "/metrics").text
    assert not [line for line in metrics.splitlines()
                if line.startswith("simple_serve_requests_total{") and 'status="5' in line and not
                line.endswith(" 0.0")], metrics
    assert stream_text(server, INNOCENT[0]) == solo[0]  # and the server serves on as before


def test_broken_tool_calls_beside_a_good_one_all_end_cleanly():
    """Malformed tool calls from a scripted model, many at once and streamed: each ends with [DONE] and no error,
    its text is content, and a client that leaves mid-stream changes nothing for the others."""
    from test_tools_api import BROKEN_ANSWERS, ask, scripted_server

    tokens = ["<tool_call>", "\n" + BROKEN_ANSWERS[0] + "\n", "</tool_call>", " Done."]
    with scripted_server(tokens) as server:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: ask(server, stream=True), range(8)))
        for status, lines in results:
            assert status == 200 and lines[-1] == "[DONE]"
            assert not any("error" in json.loads(line) for line in lines[:-1])
        assert ask(server, stream=False).json()["choices"][0]["finish_reason"] == "stop"
