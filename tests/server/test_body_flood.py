"""Two dozen 1 MiB bodies at once cost the server no probe and no stream (issue 34, finding 2): a live server, 24
concurrent bodies of 31,000 empty messages each (1,023,048 bytes, under the 1 MiB body limit).

Every one is answered 400 (too many messages) or 429 (too many requests being parsed); meanwhile `/health`'s p99
stays under 200 ms and an innocent stream's largest gap between tokens stays within twice its largest gap alone,
measured alone just before. Before, on main at b907708, the bodies were parsed and validated on the event loop:
/health's p99 was 5.6 s and the slowest body was answered after 16 s.

The innocent stream's steps are a device's: 100 ms of waiting with the GIL released (`STEP_S`), then the tiny
model's step on one CPU thread. The tiny model's own step is ~6 ms; its largest gap, ~20 ms on a quiet machine and
60-170 ms on a busy one, measures the machine's scheduler more than the server (the issue's stream, SmolLM2 on 2
cores, had gaps of 1.5-3.1 s alone). The bound still has teeth at 100 ms: with the counts checked only after
validation (MAX_MESSAGES=100000) the flood took 17 s, /health's p99 was 413 ms and the stream's largest gap 1,013 ms
against 109 ms alone; the numpy pass of the commit before this test (17 ms a body, half of it page faults) doubled
the gap in the first round of both its runs.

The machine is shared, so one quiet round is enough: up to three rounds, each its own alone-then-flooded pair; the
answers and /health's p99 must hold in every round. The flood comes from plain sockets: httpx's one client per
request cost 1.5 s of CPU on 2 cores (a TLS context each), which slowed the innocent stream as much as the server did.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import serve_process

pytestmark = [pytest.mark.server, pytest.mark.alone]
CHAT = "/v1/chat/completions"
STEP_S = 0.1
ROUNDS = 3
FLOOD = json.dumps({"model": "tiny", "max_tokens": 1,
                    "messages": [{"role": "user", "content": ""}] * 31_000}).encode()
# The server, with every engine step first waiting STEP_S with the GIL released, as on a device.
LAUNCH = f"""
import sys, time
import app.core.engine.step as step
real = step.StepRunner.run_step
step.StepRunner.run_step = lambda self, batch: (time.sleep({STEP_S}), real(self, batch))[1]
from app.__main__ import main
sys.exit(main(sys.argv[1:]))
"""
# GET /health every 20 ms from a process of its own: when each probe started, and how long it took.
PROBE = """
import pathlib, sys, time, httpx
url, out, stop = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
with httpx.Client(timeout=10) as client, out.open("w") as log:
    while not stop.exists():
        started = time.time()
        status = client.get(url + "/health").status_code
        print(status, started, time.time() - started, file=log, flush=True)
        time.sleep(0.02)
"""


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("flood") / "serve.log"
    # one token a step (no n-gram drafts), and torch on one thread: the step's CPU part is the tiny model's
    env = {"SERVED_MODEL_NAME": "tiny", "SPECULATIVE": "off", "OMP_NUM_THREADS": "1"}
    with serve_process(tiny_dir, log, env=env, launch=("-c", LAUNCH)) as url:
        yield url
    text = log.read_text()
    assert "objects frozen" in text  # app/state.py: no full collection walks the loaded model's objects again


class Probe:
    def __init__(self, url: str, folder):
        self.out, self.stop = folder / "health.txt", folder / "stop"
        self.proc = subprocess.Popen([sys.executable, "-c", PROBE, url, str(self.out), str(self.stop)])

    def finish(self) -> list[tuple[float, float]]:
        """(started, seconds) of every probe, all answered 200."""
        self.stop.touch()
        assert self.proc.wait(timeout=30) == 0
        rows = [line.split() for line in self.out.read_text().splitlines()]
        assert all(status == "200" for status, _, _ in rows)
        return [(float(started), float(seconds)) for _, started, seconds in rows]


def innocent(url: str, body: dict, decoding: threading.Event | None = None,
             until: threading.Event | None = None) -> list[float]:
    """When each token of a greedy stream arrived; `decoding` is set once it has three, and with `until` it is
    read only until five tokens after that is set (then dropped: the server cancels it)."""
    arrivals: list[float] = []
    after = None
    with httpx.stream("POST", url + CHAT, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, line
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                arrivals.append(time.time())
            if decoding is not None and len(arrivals) == 3:
                decoding.set()
            if until is not None and until.is_set():
                after = len(arrivals) if after is None else after
                if len(arrivals) >= after + 5:
                    break
    assert len(arrivals) >= 5
    return arrivals


def largest_gap(arrivals: list[float]) -> float:
    return max(b - a for a, b in zip(arrivals, arrivals[1:]))


def flood_one(port: int) -> tuple[int, str]:
    """One body, from a plain socket: the status and the error message."""
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(FLOOD)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(head + FLOOD)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    status, _, body = answer.partition(b"\r\n\r\n")
    return int(status.split(b" ", 2)[1]), json.loads(body)["error"]["message"]


def flooded_round(url: str, body: dict) -> dict:
    port = int(url.rsplit(":", 1)[1])
    decoding, done = threading.Event(), threading.Event()
    with ThreadPoolExecutor(25) as pool:
        stream = pool.submit(innocent, url, body, decoding, done)
        assert decoding.wait(60)
        started = time.time()
        answers = list(pool.map(flood_one, [port] * 24))
        ended = time.time()
        done.set()
        arrivals = stream.result()
    return {"answers": answers, "started": started, "ended": ended, "gap": largest_gap(arrivals),
            "spanned": arrivals[0] < started and arrivals[-1] > ended}


def test_24_concurrent_1_mib_bodies_stall_neither_probes_nor_streams(server, tiny_tokenizer, tmp_path):
    assert 1_000_000 < len(FLOOD) < 1_048_576
    paris = tiny_tokenizer.encode(" Paris")
    assert len(paris) == 1
    # a whole word a token, so that every token is a chunk of its own (random weights mostly make partial UTF-8)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about Paris."}], "max_tokens": 200,
            "temperature": 0, "ignore_eos": True, "stream": True, "logit_bias": {str(paris[0]): 100}}
    innocent(url=server, body={**body, "max_tokens": 12})  # warm
    probe = Probe(server, tmp_path)
    time.sleep(1)  # its interpreter has started
    rounds = []
    try:
        for _ in range(ROUNDS):
            alone = largest_gap(innocent(server, {**body, "max_tokens": 30}))
            rounds.append({"alone": alone, **flooded_round(server, body), "load": os.getloadavg()[0]})
            if rounds[-1]["gap"] <= 2 * alone or rounds[-1]["ended"] - rounds[-1]["started"] > 10:
                break  # a quiet round, or a flood that another round will not make fast
    finally:
        probes = probe.finish()
    report = []
    for r in rounds:  # the probes in flight at any time during the flood
        during = sorted(s for t, s in probes if t <= r["ended"] and t + s >= r["started"])
        r["p99"] = during[int(0.99 * (len(during) - 1))] if during else None
        r["probes"] = len(during)
        statuses = [status for status, _ in r["answers"]]
        report.append(f"24 x {len(FLOOD):,} B answered {statuses.count(400)} x 400, {statuses.count(429)} x 429 in "
                      f"{r['ended'] - r['started']:.2f} s; /health p99 {r['p99'] * 1000:.0f} ms over {len(during)} "
                      f"probes; largest token gap {r['gap'] * 1000:.0f} ms, alone {r['alone'] * 1000:.0f} ms "
                      f"(load {r['load']:.1f})" + ("" if r["spanned"] else "; the stream ended before the flood"))
    print("\n" + "\n".join(report))
    for r in rounds:
        assert r["spanned"], report
        assert {status for status, _ in r["answers"]} <= {400, 429}, r["answers"]
        assert all("MAX_MESSAGES" in m or "MAX_PREPARING" in m for _, m in r["answers"]), r["answers"]
        # A probe starts every 20 ms plus its request's time, which grows while the bodies are parsed, so a flood
        # answered in 0.09-0.15 s (a Zen 5 here) overlapped only 3 or 4 of them: one asked for each 50 ms of flood,
        # at least 2 and at most 5 (a stalled /health stays in the count: a probe in flight overlaps the flood).
        assert r["probes"] >= min(5, max(2, int((r["ended"] - r["started"]) / 0.05))), report
        assert r["p99"] < 0.2, report
    assert any(r["gap"] <= 2 * r["alone"] for r in rounds), report
