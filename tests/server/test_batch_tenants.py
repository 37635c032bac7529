"""Batch jobs on a live server process (issue 58's "done when"): SIGTERM in the middle of a batch loses no line; a
batch completes beside steady interactive traffic and a half-sent request; /health stays fast and the server's
memory flat while a batch of heavy lines runs and a 100 MiB input file is processed; the offline command takes
neither the server's API key nor its directory from the environment."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import build_tiny_model, free_port, stop, wait_until_ready
from test_batch_process import chat_lines, serve, write_jsonl
from test_body_flood import Probe

pytestmark = pytest.mark.server


def upload(url: str, path: Path, headers: dict | None = None) -> str:
    with open(path, "rb") as f:
        r = httpx.post(f"{url}/v1/files", files={"file": ("in.jsonl", f)}, data={"purpose": "batch"},
                       headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def create(url: str, file_id: str, endpoint: str = "/v1/chat/completions") -> str:
    r = httpx.post(f"{url}/v1/batches", json={"input_file_id": file_id, "completion_window": "24h",
                                              "endpoint": endpoint}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def wait_status(url: str, batch_id: str, timeout: float, status: str = "completed") -> dict:
    deadline = time.monotonic() + timeout
    while (batch := httpx.get(f"{url}/v1/batches/{batch_id}").json())["status"] != status:
        assert time.monotonic() < deadline and batch["status"] in ("validating", "in_progress", "finalizing"), batch
        time.sleep(0.1)
    return batch


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_sigterm_in_the_middle_of_a_batch_then_a_restart_answers_every_line_200(tiny_dir, tmp_path):
    port, batch_dir = free_port(), tmp_path / "batches"
    url = f"http://127.0.0.1:{port}"
    write_jsonl(tmp_path / "in.jsonl", chat_lines(200, max_tokens=16))
    with open(tmp_path / "serve.log", "ab") as log:
        proc = serve(tiny_dir, port, batch_dir, log)
        try:
            wait_until_ready(url, timeout=120, exited=lambda: proc.poll())
            batch_id = create(url, upload(url, tmp_path / "in.jsonl"))
            while httpx.get(f"{url}/v1/batches/{batch_id}").json()["request_counts"]["completed"] < 40:
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)  # a graceful restart, as an orchestrator does it
            assert proc.wait(timeout=60) == 0
            proc = serve(tiny_dir, port, batch_dir, log)
            wait_until_ready(url, timeout=120, exited=lambda: proc.poll())
            batch = wait_status(url, batch_id, 180)
            output = httpx.get(f"{url}/v1/files/{batch['output_file_id']}/content").text.splitlines()
        finally:
            proc.kill()
    assert batch["request_counts"] == {"total": 200, "completed": 200, "failed": 0}
    assert batch["error_file_id"] is None
    records = [json.loads(line) for line in output]
    assert sorted(r["custom_id"] for r in records) == sorted(f"line-{i}" for i in range(200))
    assert {r["response"]["status_code"] for r in records} == {200}


@pytest.fixture(scope="module")
def live(tiny_dir, tmp_path_factory):
    port, folder = free_port(), tmp_path_factory.mktemp("tenants")
    url = f"http://127.0.0.1:{port}"
    with open(folder / "serve.log", "ab") as log:
        proc = serve(tiny_dir, port, folder / "batches", log)
    try:
        wait_until_ready(url, timeout=120, exited=lambda: proc.poll())
        yield url, proc, folder
    finally:
        stop(proc)


def test_a_batch_completes_beside_two_busy_clients_and_a_half_sent_request(live):
    url, _, folder = live
    port = int(url.rsplit(":", 1)[1])
    stop = threading.Event()
    answered = [0, 0]

    def client(i: int) -> None:  # back to back, as fast as the server answers
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                r = c.post(f"{url}/v1/chat/completions", json={"model": "tiny", "max_tokens": 32, "ignore_eos": True,
                                                                "messages": [{"role": "user", "content": f"c{i}"}]})
                assert r.status_code == 200, r.text
                answered[i] += 1

    half = socket.create_connection(("127.0.0.1", port))  # headers and a first byte, then nothing
    half.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n{")
    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(1)
        write_jsonl(folder / "six.jsonl", chat_lines(6, max_tokens=16))
        started = time.monotonic()
        batch = wait_status(url, create(url, upload(url, folder / "six.jsonl")), 240)
        took = time.monotonic() - started
    finally:
        stop.set()
        for t in threads:
            t.join()
        half.close()
    assert batch["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    assert took < 240 and min(answered) > 0
    print(f"6-line batch beside 2 busy clients and a half-sent request: {took:.1f} s ({answered} answers)")


def test_the_servers_memory_stays_flat_while_a_100_mib_input_file_is_processed(live):
    url, proc, folder = live
    padding = "x" * 1900  # `user` is a free string: each line ~2 KB, as long prompts would make it
    path = folder / "big.jsonl"
    with open(path, "w") as f:
        for i in range(50_000):
            f.write(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"model": "tiny", "prompt": "hi", "max_tokens": 1, "user": padding}}) + "\n")
    assert path.stat().st_size > 95 * 2**20  # near BATCH_MAX_FILE_BYTES (100 MiB), the envelope under it
    before = rss_mib(proc.pid)
    peak, sampling = [before], threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            peak.append(rss_mib(proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        batch_id = create(url, upload(url, path), "/v1/completions")
        while httpx.get(f"{url}/v1/batches/{batch_id}").json()["request_counts"]["completed"] < 200:
            time.sleep(0.1)
        httpx.post(f"{url}/v1/batches/{batch_id}/cancel")
        batch = wait_status(url, batch_id, 60, "cancelled")
        content = httpx.get(f"{url}/v1/files/{batch['output_file_id']}/content")
        assert len(content.text.splitlines()) == batch["request_counts"]["completed"]
    finally:
        sampling.set()
        sampler.join()
    grew = max(peak) - before
    print(f"100 MiB input: RSS {before:.0f} MiB before, peak {max(peak):.0f} MiB (+{grew:.0f})")
    assert grew < 100, f"the server's RSS grew by {grew:.0f} MiB while a 100 MiB input file was processed"


def test_the_offline_command_ignores_the_servers_key_and_batch_dir(tiny_dir, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", chat_lines(3))
    (tmp_path / "locked").mkdir()
    env = dict(os.environ, API_KEY="server-key", BATCH_DIR=str(tmp_path / "locked"), SERVED_MODEL_NAME="tiny")
    done = subprocess.run([sys.executable, "-m", "app", "batch", str(tmp_path / "in.jsonl"), "-o",
                           str(tmp_path / "out.jsonl"), "--model", str(tiny_dir)], env=env, capture_output=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["response"]["status_code"] for r in records] == [200, 200, 200]
    assert not list((tmp_path / "locked").iterdir())  # the server's directory untouched


@pytest.mark.alone
def test_health_stays_fast_while_a_batch_of_prompt_logprob_lines_runs(tiny_tokenizer, tmp_path):
    model_dir = tmp_path / "long"
    model = build_tiny_model(len(tiny_tokenizer))
    model.config.max_position_embeddings = 4096
    model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    prompt = " ".join(f"w{i % 50}" for i in range(790))  # about 3,000 of the tiny tokenizer's tokens
    lines = [{"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 20}}
             for i in range(12)]
    write_jsonl(tmp_path / "in.jsonl", lines)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "serve.log", "ab") as log:
        proc = serve(model_dir, port, tmp_path / "batches", log)
    try:
        wait_until_ready(url, timeout=120, exited=lambda: proc.poll())
        count = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": prompt}).json()["count"]
        assert 2500 <= count <= 4000, count
        probe = Probe(url, tmp_path)
        time.sleep(0.5)
        started = time.time()
        batch = wait_status(url, create(url, upload(url, tmp_path / "in.jsonl"), "/v1/completions"), 600)
        ended = time.time()
        probes = probe.finish()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert batch["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    during = sorted(seconds for at, seconds in probes if started <= at <= ended)
    p99 = during[int(0.99 * (len(during) - 1))]
    print(f"/health p99 {p99 * 1000:.0f} ms over {len(during)} probes while 12 prompt-logprob lines "
          f"({count} tokens, top 20) ran in {ended - started:.1f} s")
    assert len(during) >= 20 and p99 < 0.2
