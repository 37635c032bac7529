"""`python -m benchmarks batch`: what a running batch costs interactive users, on one server process.

It starts `python -m app serve` with a BATCH_DIR, then sends the same interactive load twice: alone, and while a
batch of `--lines` chat lines runs (uploaded and created through /v1/files and /v1/batches). The interactive load is
`--clients` clients, each sending `--requests` streamed greedy requests one after another (`--tokens` each, EOS
ignored). It prints, for both runs, the first-token p50 and each stream's tokens/s p50, their ratios against idle,
the batch's progress during the loaded run, and the server's resident memory. The issue's goals: first token within
1.5x of idle, tokens/s within 0.8x. `--json` writes the report to a file.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from app.config import DEFAULT_MODEL
from benchmarks.compare import ServerCrashed, wait_ready
from benchmarks.processes import free_port, stop
from benchmarks.serve import Result, _one_request, percentile

PROMPT = "Explain in a few sentences how a hash map stores and finds its keys."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name or a local HF directory")
    parser.add_argument("--lines", type=int, default=200, help="chat lines in the batch")
    parser.add_argument("--line-tokens", type=int, default=64, help="max_tokens of each batch line")
    parser.add_argument("--clients", type=int, default=1, help="interactive clients at once")
    parser.add_argument("--requests", type=int, default=8, help="requests per interactive client")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per interactive request")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="server setting")
    parser.add_argument("--json", type=Path, help="write the report here")


async def interactive(url: str, model: str, clients: int, requests: int, tokens: int) -> list[Result]:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=600) as client:
        async def one_client() -> list[Result]:
            return [await _one_request(client, f"{url}/v1/chat/completions", body, True) for _ in range(requests)]
        runs = await asyncio.gather(*(one_client() for _ in range(clients)))
    return [r for run in runs for r in run]


def figures(results: list[Result]) -> dict:
    ok = [r for r in results if r.error is None and r.chunk_times]
    ttft = [r.chunk_times[0] - r.t_start for r in ok]
    # decode rate of each stream after its first token: what a reader of the stream sees
    rate = [(r.completion_tokens - 1) / (r.chunk_times[-1] - r.chunk_times[0]) for r in ok
            if (r.completion_tokens or 0) > 1 and r.chunk_times[-1] > r.chunk_times[0]]
    return {"requests": len(results), "failed": len(results) - len(ok), "ttft_p50_s": percentile(ttft, 50),
            "tokens_per_s_p50": percentile(rate, 50)}


def start_batch(url: str, model: str, lines: int, tokens: int) -> str:
    jsonl = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": model, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                                         "messages": [{"role": "user", "content": f"Write item {i} of a list of "
                                                       "facts about rivers."}]}}) + "\n" for i in range(lines))
    file_id = httpx.post(f"{url}/v1/files", files={"file": ("batch.jsonl", io.BytesIO(jsonl.encode()))},
                         data={"purpose": "batch"}, timeout=60).json()["id"]
    return httpx.post(f"{url}/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                  "completion_window": "24h"}, timeout=60).json()["id"]


def run(args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "BATCH_DIR": str(Path(tmp) / "batches"), "SERVED_MODEL_NAME": "bench"}
        env.update(item.split("=", 1) for item in args.env)
        log = open(Path(tmp) / "serve.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "--model", args.model, "--port", str(port)],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                wait_ready(url, "/ready", proc, 600, Path(tmp) / "serve.log")
            except (ServerCrashed, SystemExit):  # the log goes with the temporary folder: show its end
                raise SystemExit(f"the server did not start: {(Path(tmp) / 'serve.log').read_text()[-2000:]}") from None
            asyncio.run(interactive(url, "bench", 1, 2, 8))  # warm-up
            idle = figures(asyncio.run(interactive(url, "bench", args.clients, args.requests, args.tokens)))
            batch_id = start_batch(url, "bench", args.lines, args.line_tokens)
            while httpx.get(f"{url}/v1/batches/{batch_id}").json()["request_counts"]["completed"] < 1:
                time.sleep(0.1)  # the batch is running: lines are being decoded
            before = httpx.get(f"{url}/v1/batches/{batch_id}").json()["request_counts"]["completed"]
            loaded = figures(asyncio.run(interactive(url, "bench", args.clients, args.requests, args.tokens)))
            batch = httpx.get(f"{url}/v1/batches/{batch_id}").json()
            rss = psutil.Process(proc.pid).memory_info().rss
        finally:
            stop(proc)
            log.close()
    report = {"model": args.model, "clients": args.clients, "requests": args.requests, "tokens": args.tokens,
              "batch_lines": args.lines, "idle": idle, "with_batch": loaded,
              "batch_lines_done_during_load": batch["request_counts"]["completed"] - before,
              "batch_status_after": batch["status"], "server_rss_mib": rss / 2**20,
              "ttft_ratio": ratio(loaded["ttft_p50_s"], idle["ttft_p50_s"]),
              "tokens_per_s_ratio": ratio(loaded["tokens_per_s_p50"], idle["tokens_per_s_p50"]),
              "cpu": cpu_name()}
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def print_report(r: dict) -> None:
    def ms(v): return f"{v * 1000:.0f} ms" if v is not None else "-"
    def tps(v): return f"{v:.1f}" if v is not None else "-"
    def x(v): return f"{v:.2f}x" if v is not None else "-"
    print(f"interactive load: {r['clients']} client(s) x {r['requests']} streamed requests of {r['tokens']} tokens; "
          f"batch: {r['batch_lines']} lines ({r['cpu']})")
    print(f"{'':14}{'first token p50':>18}{'tokens/s p50':>15}")
    print(f"{'idle':14}{ms(r['idle']['ttft_p50_s']):>18}{tps(r['idle']['tokens_per_s_p50']):>15}")
    print(f"{'with batch':14}{ms(r['with_batch']['ttft_p50_s']):>18}{tps(r['with_batch']['tokens_per_s_p50']):>15}")
    print(f"{'ratio':14}{x(r['ttft_ratio']):>18}{x(r['tokens_per_s_ratio']):>15}   (goals: <= 1.5x, >= 0.8x)")
    print(f"batch lines finished during the loaded run: {r['batch_lines_done_during_load']}; "
          f"server resident memory {r['server_rss_mib']:.0f} MiB")
