"""`python -m benchmarks shortcuts`: what the prefix cache and n-gram speculation buy, through HTTP, in one run.

It starts our server as real processes on loopback ports (as `bench compare` does) and drives them with the
load client of `bench serve`:
- prefix cache: a long document (`--prefix-len` tokens) with a question, cold; then the same document with another
  question. Time to first token of the second against the first (goal: <= 0.15x at 2,500 tokens).
- speculation: two servers, `--speculative off` and `ngram`, same weights, requests round-robin: a code edit that
  copies most of its prompt (goal: >= 1.8x the decode tokens/s) and open-ended chat (goal: <= 5% slower), greedy
  and with the model's own sampling (seeded, so both servers produce the same tokens).
Decode tokens/s is per request: (completion tokens - 1) / (last token's arrival - first token's arrival).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from benchmarks import compare, record, serve as bench_serve
from benchmarks.processes import free_port, stop
from app.config import DEFAULT_MODEL, Settings
from app.metrics import parse_samples
from app.models.fetch import EMBEDDED, fetch_model

CODE = '''import json
from dataclasses import dataclass, field


@dataclass
class Inventory:
    items: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, count: int = 1) -> None:
        if count <= 0:
            raise ValueError(f"count must be positive, got {count}")
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name: str, count: int = 1) -> None:
        have = self.items.get(name, 0)
        if count > have:
            raise ValueError(f"only {have} of {name} in stock")
        self.items[name] = have - count
        if self.items[name] == 0:
            del self.items[name]

    def total(self) -> int:
        return sum(self.items.values())

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.items, f, indent=2, sort_keys=True)

    @classmethod
    def load(cls, path: str) -> "Inventory":
        with open(path) as f:
            return cls(items=json.load(f))
'''
CODE_EDIT = ("Rename the class `Inventory` to `Stock` and the method `total` to `count_all` in this file. "
             "Reply with the whole updated file only, in one code block.\n\n```python\n" + CODE + "```")
CHAT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
QUESTIONS = ("Summarise the text above in two sentences.", "Which languages does the text above use?")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name or a local HF directory")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", choices=("prefix", "speculative"), default=None, help="run one of the two parts")
    parser.add_argument("--prefix-len", type=int, default=2500, help="tokens of the shared document")
    parser.add_argument("--prefix-repeats", type=int, default=3, help="documents (each: one cold, one warm request)")
    parser.add_argument("--edit-tokens", type=int, default=256, help="max_tokens of the code edit")
    parser.add_argument("--chat-tokens", type=int, default=128, help="max_tokens of the open-ended chat")
    parser.add_argument("--repeats", type=int, default=2, help="requests per scenario and server")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--out", default=None, help="JSON path (default bench-results/shortcuts-<timestamp>.json)")


def run(args: argparse.Namespace) -> dict:
    model_dir = fetch_model(args.model, Settings().model_cache) if args.model in EMBEDDED else Path(args.model).expanduser().resolve()
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"error: --model: {model_dir} is not a model directory (no config.json)")
    out = Path(args.out or f"bench-results/shortcuts-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {**record.envelope("shortcuts", args), "model": str(model_dir), "dtype": args.dtype,
                    "device": args.device}
    if args.only in (None, "prefix"):
        with our_server(args, model_dir, out, "prefix", []) as url:
            report["prefix"] = measure_prefix(args, url, model_dir)
    if args.only in (None, "speculative"):
        with our_server(args, model_dir, out, "spec-off", ["--speculative", "off"]) as off, \
                our_server(args, model_dir, out, "spec-ngram", ["--speculative", "ngram"]) as on:
            report["speculative"] = measure_speculation(args, {"off": off, "ngram": on}, model_dir)
    out.write_text(json.dumps(report, indent=2, ensure_ascii=False))
    print_report(report)
    print(f"wrote {out}")
    return report


@contextmanager
def our_server(args, model_dir: Path, out: Path, name: str, flags: list[str]):
    port = free_port()
    log = out.with_name(f"{out.stem}-{name}.log")
    command = compare.server_command("ours", model_dir, port, args) + flags
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        compare.wait_ready(url, "/ready", proc, args.ready_timeout, log)
        yield url
    finally:
        stop(proc)


def chat(url: str, model_dir: Path, content: str, max_tokens: int, **extra) -> bench_serve.Result:
    """One streamed chat completion, timed by the load client of `bench serve`."""
    body = {"model": str(model_dir), "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, **extra}

    async def send() -> bench_serve.Result:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            return await bench_serve._one_request(client, url + "/v1/chat/completions", body, stream=True)

    result = asyncio.run(send())
    if result.error:
        raise SystemExit(f"error: {url}: {result.error}")
    return result


def decode_rate(r: bench_serve.Result) -> float:
    return (r.completion_tokens - 1) / (r.chunk_times[-1] - r.chunk_times[0])


def measure_prefix(args, url: str, model_dir: Path) -> dict:
    count = bench_serve.tokenizer_counter(model_dir)  # exact prompt lengths
    runs = []
    for i in range(args.prefix_repeats):
        document = bench_serve.build_prompt(args.prefix_len, seed=1000 + i, count_tokens=count)
        cold, warm = (chat(url, model_dir, f"{document}\n\n{q}", 4, temperature=0) for q in QUESTIONS)
        runs.append({"prompt_tokens": cold.prompt_tokens, "cold_ttft_s": cold.chunk_times[0] - cold.t_start,
                     "warm_ttft_s": warm.chunk_times[0] - warm.t_start})
        print(f"prefix {i}: {runs[-1]}", flush=True)
    cold = statistics.median(r["cold_ttft_s"] for r in runs)
    warm = statistics.median(r["warm_ttft_s"] for r in runs)
    hits = parse_samples(httpx.get(url + "/metrics").text)["simple_serve_prefix_cache_hit_tokens_total"]
    return {"runs": runs, "prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in runs),
            "cold_ttft_s": cold, "warm_ttft_s": warm, "warm_vs_cold": warm / cold,
            "hit_tokens_total": hits}


def measure_speculation(args, urls: dict[str, str], model_dir: Path) -> dict:
    scenarios = {
        "code edit, greedy": (CODE_EDIT, args.edit_tokens, {"temperature": 0}),
        "code edit, model sampling": (CODE_EDIT, args.edit_tokens, {"seed": 1}),
        "open chat, greedy": (CHAT, args.chat_tokens, {"temperature": 0}),
        "open chat, model sampling": (CHAT, args.chat_tokens, {"seed": 1}),
    }
    for url in urls.values():  # warm-up
        chat(url, model_dir, "Hello", 4)
    rates: dict[str, dict[str, list[float]]] = {name: {kind: [] for kind in urls} for name in scenarios}
    tokens: dict[str, dict[str, int]] = {name: {} for name in scenarios}
    for _ in range(args.repeats):  # round-robin, so a slow spell of a shared machine hits both servers
        for name, (content, max_tokens, extra) in scenarios.items():
            for kind, url in urls.items():
                r = chat(url, model_dir, content, max_tokens, **extra)
                rates[name][kind].append(decode_rate(r))
                tokens[name][kind] = r.completion_tokens
                print(f"{name} [{kind}]: {rates[name][kind][-1]:.1f} tok/s, {r.completion_tokens} tokens", flush=True)
    result = {}
    for name in scenarios:
        off, on = (statistics.median(rates[name][kind]) for kind in ("off", "ngram"))
        result[name] = {"off_tokens_per_s": off, "ngram_tokens_per_s": on, "speedup": on / off,
                        "completion_tokens": tokens[name], "runs": rates[name]}
    return result


def print_report(report: dict) -> None:
    print(f"\n{report['model']} ({report['dtype']}, {report['device']})")
    if "prefix" in report:
        p = report["prefix"]
        tokens = statistics.median(r["prompt_tokens"] for r in p["runs"])
        print(f"prefix cache, ~{tokens:.0f}-token prompts: TTFT cold {p['cold_ttft_s'] * 1e3:.0f} ms, "
              f"warm {p['warm_ttft_s'] * 1e3:.0f} ms -> {p['warm_vs_cold']:.3f}x")
    if "speculative" in report:
        print(f"{'decode tok/s':<28}{'off':>8}{'ngram':>8}{'ngram/off':>11}")
        for name, r in report["speculative"].items():
            print(f"{name:<28}{r['off_tokens_per_s']:>8.1f}{r['ngram_tokens_per_s']:>8.1f}{r['speedup']:>10.2f}x")
