"""`python -m benchmarks routing`: round-robin against prefix-aware routing, over N local replicas.

This stands in for a cluster behind the Kubernetes inference gateway (docker/k8s/gateway/), which we cannot run
here. It starts N copies of our server on loopback ports, each with its own share of the CPU, and replays one
trace of multi-turn chats (benchmarks/routing_policy.py: a few shared system prompts, follow-up turns that extend
earlier conversations) once per policy, with fresh replicas each time so both start from cold caches:

    round-robin   what a plain Kubernetes Service does
    prefix-aware  what the endpoint picker does with its default scorers: each replica's own /metrics (scraped
                  every 50 ms, as the picker does: waiting, running, KV usage, prefix-cache hits) plus a prefix
                  index the router keeps of which prompt blocks it sent where

It reports, per policy, the prefix-cache hit rate (the replicas' own counters: hit tokens / prompt tokens looked
up) and client-side TTFT p50 / p99, prints a table and writes JSON. The replicas' prefix caches are kept small
(--prefix-cache-bytes) so that, as in a fleet, no replica can hold every system prompt: where a request lands
then decides whether its prefix is cached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from benchmarks import compare, record, serve as bench_serve
from benchmarks.processes import free_port, stop
from benchmarks.routing_policy import PrefixAware, ReplicaView, RoundRobin, make_trace, percentile
from app.config import Settings
from app.metrics import parse_samples
from app.models.fetch import EMBEDDED, fetch_model

SCRAPE_INTERVAL_S = 0.05  # the picker's default refresh


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name or a local HF directory")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per replica (default: CPUs / N)")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation")
    parser.add_argument("--systems", type=int, default=4, help="distinct shared system prompts")
    parser.add_argument("--rules", type=int, default=16, help="lines per system prompt (~15 tokens each)")
    parser.add_argument("--rate", type=float, default=0.5, help="new conversations per second")
    parser.add_argument("--turn-gap", type=float, default=8.0, help="seconds between a conversation's turns")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--prefix-cache-bytes", default="12MiB", help="each replica's prefix cache")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1, help="replays per policy, alternating which goes first")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--out", default=None, help="JSON path (default bench-results/routing-<timestamp>.json)")


def run(args: argparse.Namespace) -> dict:
    model_dir = (fetch_model(args.model, Settings().model_cache) if args.model in EMBEDDED
                 else Path(args.model).expanduser().resolve())
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"error: --model: {model_dir} is not a model directory (no config.json)")
    if args.replicas < 1 or args.rounds < 1:
        raise SystemExit("error: --replicas and --rounds must be at least 1")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.replicas)
    trace = make_trace(args.conversations, args.turns, args.systems, args.rate, args.turn_gap, args.rules, args.seed)
    out = Path(args.out or f"bench-results/routing-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {**record.envelope("routing", args), "model": str(model_dir), "dtype": args.dtype, "replicas": args.replicas, "threads_per_replica": threads,
              "requests": len(trace), "prefix_cache_bytes": args.prefix_cache_bytes,
              "rounds": args.rounds, "cpu": cpu_name(),
              "trace": {k: getattr(args, k) for k in ("conversations", "turns", "systems", "rules", "rate",
                                                      "turn_gap", "max_tokens", "seed")},
              "policies": {}}
    runs: dict[str, list[dict]] = {"round-robin": [], "prefix-aware": []}
    for i in range(args.rounds):
        # Alternate the order, so that neither policy always meets the machine's later (or earlier) load.
        for name in list(runs) if i % 2 == 0 else reversed(list(runs)):
            with replicas(args, model_dir, out, name, threads) as urls:
                runs[name].append(asyncio.run(replay(args, trace, urls, name, str(model_dir))))
    report["policies"] = {name: pooled(rounds, args.replicas) for name, rounds in runs.items()}
    out.write_text(json.dumps(report, indent=2))
    print_table(report)
    print(f"wrote {out}")
    return report


@contextmanager
def replicas(args, model_dir: Path, out: Path, policy: str, threads: int):
    """N servers on loopback ports, each with `threads` torch threads; stopped on exit."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
    with ExitStack() as stack:
        urls, procs = [], []
        for i in range(args.replicas):
            port = free_port()
            log = out.with_name(f"{out.stem}-{policy}-{i}.log")
            command = [*compare.server_command("ours", model_dir, port, argparse.Namespace(device="cpu",
                                                                                            dtype=args.dtype)),
                       "--prefix-cache-bytes", args.prefix_cache_bytes]
            proc = subprocess.Popen(command, env=env, stdout=stack.enter_context(log.open("wb")),
                                    stderr=subprocess.STDOUT)
            stack.callback(stop, proc)
            urls.append(f"http://127.0.0.1:{port}")
            procs.append((proc, log))
        for url, (proc, log) in zip(urls, procs):
            compare.wait_ready(url, "/ready", proc, args.ready_timeout, log)
        yield urls


def index_capacity(samples: dict[str, float], prefix_cache_bytes: int) -> int:
    """Blocks of the replica's prefix cache, from its /metrics: the cache-info gauge gives the KV budget in
    16-token blocks, and so the bytes of one block."""
    [(key, _)] = [(k, v) for k, v in samples.items() if k.startswith("simple_serve_kv_cache_info{")]
    blocks = int(key.split('num_gpu_blocks="')[1].split('"')[0])
    block_bytes = samples["simple_serve_kv_cache_budget_bytes"] / max(1, blocks)
    return max(1, int(prefix_cache_bytes // block_bytes))


async def replay(args, trace, urls: list[str], policy_name: str, model_id: str) -> dict:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        async def scrape(url: str) -> dict[str, float]:
            return parse_samples((await client.get(url + "/metrics")).text)

        start_samples = [await scrape(url) for url in urls]
        views = [ReplicaView.from_samples(m) for m in start_samples]
        if policy_name == "round-robin":
            policy = RoundRobin(len(urls))
        else:
            prefix_bytes = Settings(prefix_cache_bytes=args.prefix_cache_bytes).prefix_cache_bytes  # parses "24MiB"
            policy = PrefixAware(len(urls), index_capacity(start_samples[0], prefix_bytes), seed=args.seed)

        async def refresh() -> None:
            while True:
                fresh = await asyncio.gather(*(scrape(url) for url in urls), return_exceptions=True)
                for i, m in enumerate(fresh):
                    if isinstance(m, dict):
                        views[i] = ReplicaView.from_samples(m)
                await asyncio.sleep(SCRAPE_INTERVAL_S)

        scraper = asyncio.create_task(refresh())
        t0, tasks, chosen = time.perf_counter(), [], []
        for request in trace:
            await asyncio.sleep(max(0.0, t0 + request.at - time.perf_counter()))
            replica = policy.choose(request.as_messages(), views)
            chosen.append(replica)
            body = {"model": model_id, "messages": request.as_messages(), "max_tokens": args.max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            tasks.append(asyncio.create_task(send(client, urls[replica], body)))
        results = await asyncio.gather(*tasks)
        records = [{"at": request.at, "conversation": request.conversation, "turn": request.turn,
                    "system": request.system, "replica": replica, **result}
                   for request, replica, result in zip(trace, chosen, results)]
        wall = time.perf_counter() - t0
        scraper.cancel()
        end_samples = [await scrape(url) for url in urls]
    hits, queried = count_hits(start_samples, end_samples)
    return {"hit_tokens": hits, "prompt_tokens": queried, "wall_s": wall, "requests": records}


async def send(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed chat completion: its TTFT (send -> first content delta) and the server's usage, which says
    how many prompt tokens came from the prefix cache (prompt_tokens_details.cached_tokens)."""
    t0, first, usage, error = time.perf_counter(), None, {}, None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code >= 400:
                error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
            else:
                async for line in resp.aiter_lines():
                    parsed = bench_serve.parse_sse_line(line)
                    if parsed is None or parsed[0] != "data" or parsed[1].strip() == "[DONE]":
                        continue
                    chunk = json.loads(parsed[1])
                    if "error" in chunk:
                        error = str(chunk["error"])[:200]
                        break
                    if first is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                        first = time.perf_counter()
                    usage = chunk.get("usage") or usage
    except (httpx.HTTPError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:200]
    return {"error": error, "ttft_s": None if first is None else first - t0,
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def count_hits(start: list[dict], end: list[dict]) -> tuple[float, float]:
    """Prefix-cache hit tokens and looked-up prompt tokens over a replay, from the replicas' own counters."""
    delta = lambda name: sum(e.get(name, 0.0) - s.get(name, 0.0) for s, e in zip(start, end))  # noqa: E731
    return delta("simple_serve_prefix_cache_hit_tokens_total"), delta("simple_serve_prefix_cache_queried_tokens_total")


def pooled(rounds: list[dict], n: int) -> dict:
    """One policy over all rounds: the hit rate of the pooled counters, TTFT percentiles of all requests."""
    records = [r for one in rounds for r in one["requests"]]
    hits, queried = sum(one["hit_tokens"] for one in rounds), sum(one["prompt_tokens"] for one in rounds)
    ttft = [r["ttft_s"] for r in records if r["error"] is None and r["ttft_s"] is not None]
    return {"prefix_hit_rate": hits / queried if queried else 0.0, "hit_tokens": hits, "prompt_tokens": queried,
            "ttft_s": {"p50": percentile(ttft, 50) if ttft else None, "p99": percentile(ttft, 99) if ttft else None,
                       "n": len(ttft)},
            "errors": [r["error"] for r in records if r["error"] is not None],
            "per_replica": [sum(r["replica"] == i for r in records) for i in range(n)],
            "rounds": [{"prefix_hit_rate": one["hit_tokens"] / one["prompt_tokens"] if one["prompt_tokens"] else 0.0,
                        "ttft_p50_s": percentile(t, 50) if (t := [r["ttft_s"] for r in one["requests"]
                                                                   if r["ttft_s"] is not None]) else None,
                        "wall_s": one["wall_s"]} for one in rounds],
            "requests": records}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def print_table(report: dict) -> None:
    print(f"\n{report['requests']} requests x {report['rounds']} round(s), {report['replicas']} replicas x "
          f"{report['threads_per_replica']} threads on {report['cpu']}, {Path(report['model']).name} "
          f"({report['dtype']}), prefix cache {report['prefix_cache_bytes']} each")
    print(f"{'policy':<14}{'prefix hits':>12}{'TTFT p50':>10}{'TTFT p99':>10}{'per replica':>14}{'errors':>8}")
    for name, r in report["policies"].items():
        p50, p99 = r["ttft_s"]["p50"], r["ttft_s"]["p99"]
        ms = lambda v: f"{v * 1000:.0f} ms" if v is not None else "-"  # noqa: E731
        print(f"{name:<14}{r['prefix_hit_rate']:>12.1%}{ms(p50):>10}{ms(p99):>10}"
              f"{'/'.join(map(str, r['per_replica'])):>14}{len(r['errors']):>8}")
