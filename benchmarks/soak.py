"""Soak: a long mixed load against a running server, then checks that it held up.

    python -m benchmarks soak --url http://127.0.0.1:8000 --model ID --minutes 30 [--server-pid PID]

Each of `--concurrency` workers loops over a weighted mix: streams, non-streams, streams cancelled mid-way, clients
that time out, malformed or invalid requests, and now and then a burst of `--burst` requests at once, past the
queue cap, which must get 429s rather than errors. The requests go through bench serve's client (`_one_request`).

Checks (the exit status is 1 when one fails):
- no 5xx, neither seen by the clients nor counted by the server's /metrics (a client that timed out sees nothing);
- every stream the client did not abandon ended with `data: [DONE]` or a clean error (an SSE error event, or a
  4xx/429 before it began);
- every 4xx body is OpenAI's error JSON;
- the server's RSS grew by less than 5% between minute 2 (or 20% of a shorter run) and the end: from /proc with
  --server-pid, else from /metrics' process_resident_memory_bytes. The bytes the prefix cache holds at each sample
  (/metrics' simple_serve_prefix_cache_bytes) are taken out first: that cache fills by design, up to its own bound
  PREFIX_CACHE_BYTES, so its growth is not a leak. The raw RSS is reported too;
- once the load stops, active sequences, queued requests and KV cache bytes in use go back to 0 (from /metrics);
- `/health` answered within `--health-p99-ms` (100 ms) at the 99th percentile throughout the load: probed every
  `HEALTH_PROBE_S` from a thread of its own, so the soak's own busy event loop is not what is measured. A server
  whose event loop stalls (per-token work on it, a lock held too long) fails this.

The JSON it writes (`--out`) starts with `record.envelope`: the machine, versions, settings and date, as every
bench's does, so docs/results/ can keep a run and `make docs-figures` print its table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks import record
from benchmarks.serve import Result, _one_request, build_prompt
from benchmarks.soak_report import END_GRACE_S, KV_GAUGE, print_report
from app.metrics import parse_samples

RSS_GROWTH_LIMIT = 0.05
RSS_SAMPLE_S = 5.0
SETTLE_S = 30.0  # how long the server may take to free everything after the load stops
HEALTH_PROBE_S = 0.1
# (kind, weight): the mix each worker draws from
MIX = (("stream", 40), ("non_stream", 22), ("cancel", 12), ("timeout", 6), ("bad", 15), ("burst", 5))
BAD_BODIES: list[tuple[str, dict | bytes]] = [
    ("invalid-json", b'{"model": "x", "messages": ['),
    ("temperature", {"temperature": -1}),
    ("messages-empty", {"messages": []}),
    ("unknown-model", {"model": "no-such-model"}),
    ("context", {"max_tokens": 10**9}),
    ("top-p", {"top_p": 0}),
    ("logit-bias", {"logit_bias": {"-3": 1}}),
]


@dataclass
class Tally:
    """What the clients saw, by kind of request."""

    sent: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # each one a failed check, with what was seen
    streams_ok: int = 0
    streams_clean_error: int = 0
    cancelled: int = 0
    timed_out: int = 0
    rejected_429: int = 0
    bursts: int = 0
    cut_at_end: int = 0  # workers whose request was still running END_GRACE_S after the deadline
    completion_tokens: int = 0

    def count(self, kind: str, res: Result) -> None:
        self.sent[kind] = self.sent.get(kind, 0) + 1
        key = str(res.status) if res.status is not None else "none"
        self.statuses[key] = self.statuses.get(key, 0) + 1
        self.rejected_429 += res.status == 429
        self.completion_tokens += res.completion_tokens or 0

    def fail(self, message: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(message)


def openai_error(text: str) -> bool:
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


class Soak:
    def __init__(self, args):
        self.args = args
        self.base = args.url.rstrip("/").removesuffix("/v1")
        self.url = self.base + "/v1/chat/completions"
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.rss: list[tuple[float, int, int]] = []  # (seconds since start, RSS bytes, prefix cache bytes)
        self.health_s: list[float] = []  # each /health probe's latency
        self.prompts = [build_prompt(self.rng.choice((16, 64, 200)), args.seed + i) for i in range(64)]

    def body(self, stream: bool, max_tokens: int) -> dict:
        body = {"model": self.args.model, "stream": stream, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": self.rng.choice(self.prompts)}],
                "temperature": self.rng.choice((0, 0.7, 1.0))}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def one(self, client: httpx.AsyncClient, kind: str) -> None:
        rng, t = self.rng, self.tally
        if kind == "bad":
            name, bad = rng.choice(BAD_BODIES)
            body = bad if isinstance(bad, bytes) else {**self.body(False, 8), **bad}
            res = await _one_request(client, self.url, body, stream=False)
            t.count(kind, res)
            if res.status is None or not 400 <= res.status < 500:
                t.fail(f"bad request {name}: expected a 4xx, got {res.status} ({res.error})")
            elif not openai_error(res.error_body or ""):
                t.fail(f"bad request {name}: {res.status} without OpenAI error JSON: {res.error_body!r:.200}")
            return
        if kind == "timeout":  # an impatient client: its read times out while the server still generates
            res = await _one_request(client, self.url, self.body(False, 256), stream=False,
                                     timeout=rng.uniform(0.2, 1.5))
            t.count(kind, res)
            if res.status is None:
                t.timed_out += 1
            else:
                self.check_status(kind, res)
            return
        stream = kind != "non_stream"
        if kind == "cancel":  # the client goes away mid-stream: the server must free the request at once
            task = asyncio.ensure_future(_one_request(client, self.url, self.body(True, 256), stream=True))
            done, _ = await asyncio.wait([task], timeout=rng.uniform(0.2, 3.0))
            if not done:
                task.cancel()
                t.cancelled += 1
                t.sent[kind] = t.sent.get(kind, 0) + 1
                return
            res = task.result()
        else:
            res = await _one_request(client, self.url, self.body(stream, rng.choice((8, 32, 96))), stream=stream)
        t.count(kind, res)
        (self.check_stream if stream else self.check_status)(kind, res)

    def check_status(self, kind: str, res: Result) -> None:
        if res.status is None:
            self.tally.fail(f"{kind}: no response: {res.error}")
        elif res.status >= 500:
            self.tally.fail(f"{kind}: HTTP {res.status}: {res.error}")
        elif res.status >= 400 and not openai_error(res.error_body or ""):
            self.tally.fail(f"{kind}: {res.status} without OpenAI error JSON: {res.error_body!r:.200}")

    def check_stream(self, kind: str, res: Result) -> None:
        self.check_status(kind, res)
        if res.status == 200:
            if res.done and res.error is None:
                self.tally.streams_ok += 1
            elif res.error is not None and res.error.startswith("SSE error"):
                self.tally.streams_clean_error += 1  # an error event: clean, if not what we hoped for
            else:
                self.tally.fail(f"{kind}: stream ended without [DONE] or an error event: {res.error}")
        elif res.status is not None and 400 <= res.status < 500:
            self.tally.streams_clean_error += 1

    async def burst(self, client: httpx.AsyncClient) -> None:
        """More requests at once than the server admits and queues: the rest must get 429, not errors. Short
        answers, so that a burst does not hold the server for minutes."""
        self.tally.bursts += 1

        async def short(stream: bool) -> None:
            res = await _one_request(client, self.url, self.body(stream, 4), stream=stream)
            self.tally.count("burst", res)
            (self.check_stream if stream else self.check_status)("burst", res)

        await asyncio.gather(*(short(i % 2 == 0) for i in range(self.args.burst)))

    async def worker(self, client: httpx.AsyncClient, deadline: float) -> None:
        kinds, weights = zip(*MIX)
        while time.monotonic() < deadline:
            kind = self.rng.choices(kinds, weights)[0]
            try:
                await (self.burst(client) if kind == "burst" else self.one(client, kind))
            except Exception as err:  # noqa: BLE001 - a soak reports what broke and goes on
                self.tally.fail(f"{kind}: client error {type(err).__name__}: {err}")

    async def sample_rss(self, client: httpx.AsyncClient, started: float, deadline: float) -> None:
        while time.monotonic() < deadline:
            sample = await self.read_rss(client)
            if sample is not None:
                self.rss.append((time.monotonic() - started, *sample))
            await asyncio.sleep(min(RSS_SAMPLE_S, max(0.1, deadline - time.monotonic())))

    async def read_rss(self, client: httpx.AsyncClient) -> tuple[int, int] | None:
        """(the server's RSS, the bytes its prefix cache holds), or None when the RSS is not to be had."""
        metrics = await self.metrics(client)
        cached = int(metrics.get(PREFIX_GAUGE, 0))
        if self.args.server_pid:
            for line in Path(f"/proc/{self.args.server_pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024, cached
        rss = metrics.get("process_resident_memory_bytes")
        return None if rss is None else (int(rss), cached)

    def probe_health(self, deadline: float) -> None:
        """GET /health every HEALTH_PROBE_S until the deadline, recording each answer's latency (a failed probe
        counts as its timeout)."""
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                started = time.perf_counter()
                try:
                    client.get(self.base + "/health")
                except httpx.HTTPError:
                    pass
                self.health_s.append(time.perf_counter() - started)
                time.sleep(max(0.0, HEALTH_PROBE_S - (time.perf_counter() - started)))

    async def metrics(self, client: httpx.AsyncClient) -> dict[str, float]:
        """/metrics as {name or name{labels}: value}."""
        return parse_samples((await client.get(self.base + "/metrics", timeout=10)).text)

    async def run(self) -> dict:
        args = self.args
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=args.concurrency)
        async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
            before = await self.metrics(client)
            started = time.monotonic()
            deadline = started + args.minutes * 60
            workers = [asyncio.ensure_future(self.worker(client, deadline)) for _ in range(args.concurrency)]
            probe = threading.Thread(target=self.probe_health, args=(deadline,), daemon=True)
            probe.start()
            await self.sample_rss(client, started, deadline)
            await asyncio.to_thread(probe.join)
            # requests still running at the deadline get END_GRACE_S to finish; the rest are cut (the client
            # leaves, as a cancel does), so --minutes bounds the run even on a server that has fallen far behind
            _, late = await asyncio.wait(workers, timeout=END_GRACE_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            self.tally.cut_at_end = len(late)
            load_s = time.monotonic() - started
            settled, after = await self.settle(client)
            self.rss.append((time.monotonic() - started, *(await self.read_rss(client) or (0, 0))))
        return self.report(before, after, settled, load_s)

    async def settle(self, client: httpx.AsyncClient) -> tuple[float | None, dict[str, float]]:
        """Seconds until nothing is active, queued or held in the KV cache (None: never within SETTLE_S)."""
        started = time.monotonic()
        while True:
            after = await self.metrics(client)
            if all(after.get(name, 0) == 0 for name in IDLE_GAUGES):
                return time.monotonic() - started, after
            if time.monotonic() - started > SETTLE_S:
                return None, after
            await asyncio.sleep(0.2)

    def report(self, before: dict[str, float], after: dict[str, float], settled: float | None,
               load_s: float) -> dict:
        t = self.tally
        server_5xx = sum(v - before.get(k, 0) for k, v in after.items()
                         if k.startswith("simple_serve_requests_total{") and 'status="5' in k)
        rss = self.rss_growth()
        gauges = {name: after.get(name) for name in IDLE_GAUGES}
        health_ms = [1000 * s for s in sorted(self.health_s)]
        at = lambda q: health_ms[min(len(health_ms) - 1, int(q * len(health_ms)))] if health_ms else None  # noqa: E731
        health = {"probes": len(health_ms), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": at(1.0)}
        checks = {
            "no 5xx seen by clients": not any(s.startswith("5") for s in t.statuses),
            "no 5xx counted by the server": server_5xx == 0,
            "streams ended with [DONE] or a clean error, 4xx bodies are OpenAI errors": not t.failures,
            "bursts past the queue cap got 429": t.rejected_429 > 0 or not t.bursts,
            f"RSS less the prefix cache grew < {RSS_GROWTH_LIMIT:.0%} from {rss['from_s']:.0f} s to the end":
                rss["growth"] is not None and rss["growth"] < RSS_GROWTH_LIMIT,
            "active, queued and KV bytes back to 0": settled is not None,
            f"/health p99 under {self.args.health_p99_ms:g} ms during the load":
                health["p99_ms"] is not None and health["p99_ms"] < self.args.health_p99_ms,
        }
        return {"config": {k: v for k, v in vars(self.args).items() if k != "func"}, "load_s": load_s,
                "requests": t.sent, "statuses": t.statuses, "streams_ok": t.streams_ok,
                "streams_clean_error": t.streams_clean_error, "cancelled_mid_stream": t.cancelled,
                "client_timeouts": t.timed_out, "rejected_429": t.rejected_429, "bursts": t.bursts,
                "cut_at_end": t.cut_at_end, "completion_tokens": t.completion_tokens, "server_5xx": server_5xx,
                "rss": rss, "idle_gauges_after": gauges, "kv_gauge_exposed": KV_GAUGE in after, "settled_s": settled,
                "health": health, "failures": t.failures, "checks": checks, "ok": all(checks.values())}

    def rss_growth(self) -> dict:
        if not self.rss:
            return {"from_s": 0.0, "start_bytes": None, "end_bytes": None, "growth": None, "raw_growth": None}
        total = self.rss[-1][0]
        baseline_at = min(120.0, 0.2 * total)  # minute 2, or a fifth of a short run
        start = next((sample for sample in self.rss if sample[0] >= baseline_at), self.rss[0])
        end = self.rss[-1]
        net_start, net_end = start[1] - start[2], end[1] - end[2]
        return {"from_s": start[0], "start_bytes": start[1], "end_bytes": end[1],
                "prefix_cache_start_bytes": start[2], "prefix_cache_end_bytes": end[2],
                "peak_bytes": max(sample[1] for sample in self.rss),
                "growth": (net_end - net_start) / net_start if net_start > 0 else None,
                "raw_growth": (end[1] - start[1]) / start[1] if start[1] else None, "samples": len(self.rss)}


PREFIX_GAUGE = "simple_serve_prefix_cache_bytes"
IDLE_GAUGES = ("simple_serve_active_sequences", "simple_serve_queue_depth", KV_GAUGE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (with or without /v1)")
    parser.add_argument("--model", required=True, help="model id sent in the request body")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to keep the load on")
    parser.add_argument("--concurrency", type=int, default=8, help="workers sending requests one after another")
    parser.add_argument("--burst", type=int, default=96, help="requests sent at once in a burst (past the queue cap)")
    parser.add_argument("--server-pid", type=int, default=None, help="read the server's RSS from /proc/PID")
    parser.add_argument("--timeout", type=float, default=300.0, help="per-request timeout of patient clients, s")
    parser.add_argument("--health-p99-ms", type=float, default=100.0, help="the /health latency the server must "
                        "keep at the 99th percentile during the load")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON path (default bench-results/soak-<timestamp>.json)")


def run(args) -> int:
    head = record.envelope("soak", args)  # dated when the load starts
    result = {**head, **asyncio.run(Soak(args).run())}
    out = Path(args.out or f"bench-results/soak-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False))
    print_report(result)
    print(f"  wrote {out}")
    return 0 if result["ok"] else 1
