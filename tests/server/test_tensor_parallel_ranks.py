"""Real ranks: `torchrun --nproc-per-node N -m app serve --tensor-parallel N` over gloo on this CPU, against the
single-process server on the same weights in fp32, and a follower killed with SIGKILL mid-stream.

One torch thread per rank (OMP_NUM_THREADS=1, torchrun's own default): the ranks share this machine's cores."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from app.config import Settings
from app.models.fetch import fetch_model

from conftest import MODEL_CACHE, free_port
from test_server_real import ServerProcess, clean_env

pytestmark = pytest.mark.server
CHAT = "/v1/chat/completions"
QUESTIONS = ["Which city is the capital of France?", "Write a haiku about the sea.",
             "def fib(n): # complete this Python function", "Name three colours.", "Count from one to ten."]


def torchrun_server(tmp_path, model: str, ranks: int, **env: str) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), "-m", "app", "serve", "--tensor-parallel", str(ranks),
            "--model", model, "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)]
    srv = ServerProcess(tmp_path / "ranks.log", clean_env(OMP_NUM_THREADS="1", **env), argv=argv, port=port)
    srv.start()
    try:
        srv.wait_ready()
    except BaseException:
        srv.stop()
        raise
    return srv


def answers(url: str, model_id: str, max_tokens: int) -> list[tuple[str, str, int]]:
    """Greedy answers to QUESTIONS, all sent at once so the server batches them."""
    def ask(question: str) -> tuple[str, str, int]:
        r = httpx.post(url + CHAT, timeout=300, json={
            "model": model_id, "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": max_tokens})
        assert r.status_code == 200, r.text
        body = r.json()
        return body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"], \
            body["usage"]["completion_tokens"]

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        return list(pool.map(ask, QUESTIONS))


def single_process_answers(tmp_path, model: str, max_tokens: int) -> list[tuple[str, str, int]]:
    """The same questions to the plain server, one process (one torch thread too: this machine is shared, and
    OpenMP threads spinning against other processes' made it several times slower)."""
    port = free_port()
    argv = [sys.executable, "-m", "app", "serve", "--model", model, "--dtype", "float32", "--host", "127.0.0.1",
            "--port", str(port)]
    srv = ServerProcess(tmp_path / "single.log", clean_env(OMP_NUM_THREADS="1"), argv=argv, port=port).start()
    try:
        srv.wait_ready()
        return answers(srv.url, Settings(model=model).model_id, max_tokens)
    finally:
        srv.stop()


def rank_process(srv: ServerProcess, rank: int) -> psutil.Process:
    for child in psutil.Process(srv.proc.pid).children(recursive=True):
        if child.environ().get("RANK") == str(rank) and "app" in child.cmdline():
            return child
    raise AssertionError(f"no rank {rank} under torchrun\n{srv.log_tail()}")


def test_two_gloo_ranks_equal_one_process_and_a_killed_rank_fails_cleanly(tmp_path, tiny_dir):
    model = str(tiny_dir)
    expected = single_process_answers(tmp_path, model, max_tokens=24)
    srv = torchrun_server(tmp_path, model, 2)
    failed = True
    try:
        assert answers(srv.url, tiny_dir.name, max_tokens=24) == expected

        # Kill the follower mid-stream: the stream ends with an error event, never a hang; from then on the server
        # is never ready, and torchrun exits with an error for its supervisor to restart it.
        probes: list[int] = []
        stop_probing = threading.Event()

        def probe() -> None:
            while not stop_probing.is_set():
                try:
                    probes.append(httpx.get(srv.url + "/ready", timeout=2).status_code)
                except httpx.HTTPError:
                    probes.append(0)  # gone
                time.sleep(0.02)

        with httpx.stream("POST", srv.url + CHAT, timeout=30, json={
                "model": tiny_dir.name, "messages": [{"role": "user", "content": "Tell me a long story."}],
                "temperature": 0, "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            rank_process(srv, 1).send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        threading.Thread(target=probe, daemon=True).start()  # once the stream has its error: never ready again
        assert rest[-1] == "[DONE]", rest[-3:]
        error = json.loads(rest[-2])["error"]
        assert error["code"] == "engine_dead" and "rank" in error["message"], error
        assert time.monotonic() - killed_at < 10
        assert srv.proc.wait(timeout=60) != 0
        stop_probing.set()
        assert 200 not in probes, probes
        failed = False
    finally:
        srv.stop()
        if failed:
            print("\n" + srv.log_tail(), file=sys.stderr)


@pytest.mark.real_model
def test_smollm2_on_three_gloo_ranks_equals_one_process(tmp_path):
    """SmolLM2-135M has 9 attention heads and 3 key/value heads: 3 ranks, not 2 (which it refuses)."""
    model = str(fetch_model("smollm2-135m-instruct", MODEL_CACHE))
    expected = single_process_answers(tmp_path, model, max_tokens=24)
    srv = torchrun_server(tmp_path, model, 3)
    failed = True
    try:
        assert answers(srv.url, "smollm2-135m-instruct", max_tokens=24) == expected
        failed = False
    finally:
        srv.stop()
        if failed:
            print("\n" + srv.log_tail(), file=sys.stderr)
