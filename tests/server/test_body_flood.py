"""Two dozen 1 MiB bodies at once cost the server no probe and no stream (issue 34, finding 2): a live server, the
tiny model, 24 concurrent bodies of 31,000 empty messages each (1,023,065 bytes, under the 1 MiB body limit).

Every one is answered 400 (too many messages) or 429 (too many requests being parsed); meanwhile `/health`'s p99
stays under 200 ms and an innocent stream's largest gap between tokens stays within twice its largest gap alone.
Before, on main at b907708, the bodies were parsed and validated on the event loop: /health's p99 was seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import free_port, wait_until_ready
from test_adversarial import HealthProbe

pytestmark = pytest.mark.server
CHAT = "/v1/chat/completions"
FLOOD = json.dumps({"model": "tiny", "max_tokens": 1,
                    "messages": [{"role": "user", "content": ""}] * 31_000}).encode()
INNOCENT = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about Paris."}], "max_tokens": 200,
            "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("flood") / "serve.log"
    env = dict(os.environ, SERVED_MODEL_NAME="tiny")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "--model", str(tiny_dir), "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_until_ready(url, timeout=120, exited=lambda: proc.poll())
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def stream_gaps(url: str) -> list[float]:
    """The seconds between one token's chunk and the next, over a whole greedy stream."""
    arrivals = []
    with httpx.stream("POST", url + CHAT, json=INNOCENT, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                assert "error" not in json.loads(line[6:]), line
                arrivals.append(time.perf_counter())
    assert len(arrivals) > 100
    return [b - a for a, b in zip(arrivals[1:], arrivals[2:])]  # from the first token on: not the prefill


def flood_one(url: str) -> tuple[int, str]:
    r = httpx.post(url + CHAT, content=FLOOD, headers={"content-type": "application/json"}, timeout=120)
    return r.status_code, r.json()["error"]["message"]


def test_24_concurrent_1_mib_bodies_stall_neither_probes_nor_streams(server, tmp_path):
    assert 1_000_000 < len(FLOOD) < 1_048_576
    alone = max(max(stream_gaps(server)) for _ in range(3))  # the worst of three solo runs: the machine is shared
    probe = HealthProbe(server, tmp_path)
    time.sleep(1)  # its interpreter has started
    gaps: list[float] = []
    flooded = threading.Event()

    def innocent() -> None:  # streams back to back, for as long as the flood lasts
        while not flooded.is_set():
            gaps.extend(stream_gaps(server))

    try:
        with ThreadPoolExecutor(25) as pool:
            streams = pool.submit(innocent)
            time.sleep(0.1)  # decoding when the bodies arrive
            started = time.perf_counter()
            answers = [f.result() for f in [pool.submit(flood_one, server) for _ in range(24)]]
            flood_s = time.perf_counter() - started
            flooded.set()
            streams.result()
    finally:
        latencies = probe.latencies()
    statuses = sorted(status for status, _ in answers)
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(f"\n24 x {len(FLOOD):,} B: statuses {statuses}, slowest answer after {flood_s:.2f} s; /health p99 "
          f"{p99 * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms over {len(latencies)} probes; largest token gap "
          f"{max(gaps) * 1000:.0f} ms (alone {alone * 1000:.0f} ms)")
    assert set(statuses) <= {400, 429}, answers
    assert all("MAX_MESSAGES" in m or "MAX_PREPARING" in m for _, m in answers), answers
    assert len(latencies) > 20 and p99 < 0.2, f"/health p99 {p99 * 1000:.0f} ms"
    assert max(gaps) <= 2 * alone, f"largest token gap {max(gaps) * 1000:.0f} ms, alone {alone * 1000:.0f} ms"
