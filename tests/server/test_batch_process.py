"""Batch jobs across process deaths: a server killed with SIGKILL halfway through a batch resumes it at its next
start, and `python -m app batch` resumes after Ctrl-C; in both, every line is answered exactly once."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import time

import httpx
import pytest

from conftest import free_port, wait_until_ready

pytestmark = pytest.mark.server


def chat_lines(count: int, max_tokens: int = 8) -> list[dict]:
    return [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "tiny", "messages": [{"role": "user", "content": f"item {i}"}], "temperature": 0,
                      "max_tokens": max_tokens, "ignore_eos": True}} for i in range(count)]


def write_jsonl(path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def serve(tiny_dir, port: int, batch_dir, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "app", "serve", "--model", str(tiny_dir), "--port", str(port),
                             "--served-model-name", "tiny", "--batch-dir", str(batch_dir)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd())


def test_a_batch_killed_with_sigkill_halfway_completes_after_a_restart_with_each_line_once(tiny_dir, tmp_path):
    port, batch_dir = free_port(), tmp_path / "batches"
    url = f"http://127.0.0.1:{port}"
    write_jsonl(tmp_path / "in.jsonl", chat_lines(200))
    with open(tmp_path / "serve.log", "ab") as log:
        proc = serve(tiny_dir, port, batch_dir, log)
        try:
            wait_until_ready(url, timeout=120, exited=lambda: proc.poll())
            with open(tmp_path / "in.jsonl", "rb") as f:
                file_id = httpx.post(f"{url}/v1/files", files={"file": ("in.jsonl", f)},
                                     data={"purpose": "batch"}).json()["id"]
            batch_id = httpx.post(f"{url}/v1/batches", json={"input_file_id": file_id, "completion_window": "24h",
                                                              "endpoint": "/v1/chat/completions"}).json()["id"]
            while httpx.get(f"{url}/v1/batches/{batch_id}").json()["request_counts"]["completed"] < 100:
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            proc = serve(tiny_dir, port, batch_dir, log)  # the same BATCH_DIR: it resumes at start
            wait_until_ready(url, timeout=120, exited=lambda: proc.poll())
            deadline = time.monotonic() + 180
            while (batch := httpx.get(f"{url}/v1/batches/{batch_id}").json())["status"] != "completed":
                assert time.monotonic() < deadline and batch["status"] in ("in_progress", "finalizing"), batch
                time.sleep(0.1)
            output = httpx.get(f"{url}/v1/files/{batch['output_file_id']}/content").text.splitlines()
        finally:
            proc.kill()
    ids = [json.loads(line)["custom_id"] for line in output]
    assert len(ids) == 200 and sorted(ids) == sorted(f"line-{i}" for i in range(200))
    assert batch["request_counts"] == {"total": 200, "completed": 200, "failed": 0}
    assert batch["error_file_id"] is None


def test_the_batch_command_shows_progress_and_resumes_after_ctrl_c_without_repeating_a_line(tiny_dir, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", chat_lines(100))
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "app", "batch", str(tmp_path / "in.jsonl"), "-o", str(out), "--model",
               str(tiny_dir), "--served-model-name", "tiny", "--max-active", "2"]
    # first run: stderr on a terminal (a pty), so tqdm draws its bar; Ctrl-C (SIGINT) once some lines are written
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a terminal 120 columns wide
    # Ctrl-C at a terminal reaches a process whose SIGINT is the default; a suite started as a background job of a
    # non-interactive shell (`make test &`) hands its children SIGINT ignored, and Python then installs no handler:
    # the command ran to its end and exited 0 instead of 130. So the child gets the terminal's default back.
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=secondary, cwd=os.getcwd(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(secondary)
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_text().count("\n") >= 10):
            assert proc.poll() is None and time.monotonic() < deadline, "no lines written"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    terminal = b""
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:
            break
        if not chunk:
            break
        terminal += chunk
    os.close(primary)
    screen = terminal.decode(errors="replace")
    assert "batch:" in screen and "/100" in screen and "tok/s" in screen, screen[-2000:]  # tqdm's bar
    assert "--resume" in screen  # how to go on
    first = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
    assert 10 <= len(first) < 100
    # second run: not a terminal, so plain progress lines; it skips what the first wrote
    resumed = subprocess.run(command + ["--resume"], capture_output=True, text=True, cwd=os.getcwd(), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"batch: 100/100 lines" in resumed.stderr and f"({100 - len(first)} this run, 0 failed)" in resumed.stderr
    ids = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"line-{i}" for i in range(100))  # each once


def test_the_batch_command_names_the_line_of_a_malformed_input(tmp_path, tiny_dir):
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
                                       '"body": {}}\n{"custom_id": "a"}\n')
    r = subprocess.run([sys.executable, "-m", "app", "batch", str(tmp_path / "in.jsonl"), "-o",
                        str(tmp_path / "out.jsonl"), "--model", str(tiny_dir)], capture_output=True, text=True,
                       cwd=os.getcwd(), timeout=120)
    assert r.returncode == 2 and "line 2" in r.stderr and "INPUT" in r.stderr and "Traceback" not in r.stderr
