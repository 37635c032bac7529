"""Load benchmark for any OpenAI-compatible chat server (ours, `transformers serve`, vLLM).

    python -m benchmarks serve --url http://127.0.0.1:8000 --model ID \
        --concurrency 8 --requests 64 --prompt-len 512 --max-tokens 128 --stream

Sends M requests to POST {url}/v1/chat/completions, at most N in flight, with
`temperature: 0` (or --temperature; `none` leaves it to the server's model
defaults), `max_tokens: T` and (unless --no-ignore-eos) the vLLM-style
`ignore_eos: true`, so that every request decodes exactly T tokens and runs are
comparable across servers. Prints a table and writes JSON (--out).

Prompts are built from a fixed set of English and Chinese passages, chosen with
random.Random(seed + request_index): reproducible across runs, yet different per
request so that a prefix cache cannot make every request after the first free.
Prompt length is an *estimate* (~4 chars/token for English, ~1.5 chars/token for
CJK) unless --tokenizer is given; the server's usage.prompt_tokens is what we
report as measured, since only the server knows its tokenizer and chat template.

Metrics: TTFT (streaming only) = request send -> first non-empty content delta.
A chunk may carry several tokens, so ITL is reported both per output token,
(t_last - t_first) / (completion_tokens - 1) per request, and as raw gaps between
content chunks. Completion tokens come from usage (stream_options.include_usage);
without usage we fall back to the content-chunk count. Per-stream tok/s =
completion tokens / request latency; aggregate = all completion tokens / wall time.
HTTP errors, SSE `error` events and transport failures are counted, never raised.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

# Mixed on purpose: CJK text tokenizes very differently from English, and a
# bench that only sends ASCII hides tokenizer/detokenizer costs.
PASSAGES_EN = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "Large language models predict the next token given all the tokens that came before it.",
    "A good benchmark is boring: fixed inputs, fixed outputs, and numbers you can reproduce.",
    "The river wound through the valley, carrying snowmelt from the mountains to the sea.",
    "Caching the keys and values of past tokens turns quadratic work into linear work per step.",
    "She opened the old book and found a pressed flower between pages forty and forty-one.",
    "Throughput and latency pull in opposite directions; batching helps one and hurts the other.",
]
PASSAGES_ZH = [
    "春天来了，公园里的花都开了，孩子们在草地上放风筝。",
    "大型语言模型根据前面的所有词元来预测下一个词元。",
    "一个好的基准测试应该是可重复的：输入固定，输出固定，结果可以复现。",
    "河水穿过山谷，把雪山融化的水带向遥远的大海。",
    "缓存过去词元的键和值，可以让每一步的计算量从平方级降到线性级。",
    "她打开那本旧书，在第四十页和第四十一页之间发现了一朵压干的花。",
    "吞吐量和延迟往往互相矛盾，批处理能提高前者，却会增加后者。",
]


MIXED_PROMPT_LENS = (100, 1500)  # tokens, uniform per request
MIXED_MAX_TOKENS = (16, 600)


def mixed_workload(requests: int, seed: int,
                   count_tokens: Callable[[str], float] | None = None) -> tuple[list[str], list[int]]:
    """Prompts of mixed lengths with answers of mixed lengths, the same for every server given the same seed: how
    a chat service's traffic looks, rather than N equal requests."""
    rng = random.Random(seed)
    lengths = [rng.randint(*MIXED_PROMPT_LENS) for _ in range(requests)]
    answers = [rng.randint(*MIXED_MAX_TOKENS) for _ in range(requests)]
    return [build_prompt(n, seed + i, count_tokens) for i, n in enumerate(lengths)], answers


def estimate_tokens(text: str) -> float:
    """Rough token count: ~1.5 chars/token for CJK, ~4 chars/token otherwise."""
    cjk = sum(1 for ch in text if "\u3000" <= ch <= "\u9fff" or "\uff00" <= ch <= "\uffef")
    return cjk / 1.5 + (len(text) - cjk) / 4


def tokenizer_counter(tokenizer: str | Path) -> Callable[[str], int]:
    """An HF tokenizer (a hub id or a directory) as a token counter, for exact prompt lengths."""
    from transformers import AutoTokenizer  # lazy: only exact prompt lengths need it

    tok = AutoTokenizer.from_pretrained(tokenizer)
    return lambda text: len(tok.encode(text, add_special_tokens=False))


def build_prompt(prompt_len: int, seed: int, count_tokens: Callable[[str], float] | None = None) -> str:
    """Concatenate built-in passages (alternating English/Chinese, seeded) to ~prompt_len tokens.

    Overshoots by at most one passage; exact lengths are not worth the complexity
    because the chat template adds tokens the client cannot see anyway.
    """
    count = count_tokens or estimate_tokens
    rng = random.Random(seed)
    pools = [PASSAGES_EN, PASSAGES_ZH]
    lang = rng.randrange(2)
    parts: list[str] = []
    while not parts or count(" ".join(parts)) < prompt_len:
        parts.append(rng.choice(pools[lang]))
        lang ^= 1
    return " ".join(parts)


def percentile(values: list[float], q: float) -> float | None:
    """q-th percentile (0..100) with linear interpolation; None for no data, the value for one."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def parse_sse_line(line: str) -> tuple[str, str] | None:
    """One SSE line -> ("data", payload) or ("event", name); None for comments, pings and blanks."""
    if line.startswith("data:"):
        return "data", line[5:].removeprefix(" ")
    if line.startswith("event:"):
        return "event", line[6:].strip()
    return None  # ":" comments (keep-alive pings), "id:", "retry:", blank separators


def _error_message(payload: str) -> str:
    try:
        err = json.loads(payload)
    except ValueError:
        return payload[:300]
    err = err.get("error", err) if isinstance(err, dict) else err
    return str(err.get("message", err) if isinstance(err, dict) else err)[:300]


@dataclass
class Result:
    t_start: float
    t_end: float = 0.0
    error: str | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each non-empty content chunk
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    status: int | None = None  # HTTP status; None when no response came
    done: bool = False  # a stream's `data: [DONE]` arrived
    error_body: str | None = None  # the body of a 4xx/5xx answer


async def _read_sse(resp: httpx.Response, res: Result) -> dict:
    """Consume an SSE body, timestamping content chunks; returns the last usage seen ({} if none)."""
    usage, event = {}, None
    async for line in resp.aiter_lines():
        parsed = parse_sse_line(line)
        if parsed is None:
            event = event if line else None  # a blank line ends the current event
            continue
        kind, value = parsed
        if kind == "event":
            event = value
            continue
        if value.strip() == "[DONE]":
            res.done = True
            break
        chunk = None if event == "error" else json.loads(value)
        if chunk is None or "error" in chunk:  # `event: error`, or an error object sent as plain data
            res.error = f"SSE error: {_error_message(value)}"
            break
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            # Reasoning servers stream thinking tokens in a side field; those are output tokens too.
            if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
                res.chunk_times.append(time.perf_counter())
                break
        usage = chunk.get("usage") or usage
    return usage


async def _one_request(client: httpx.AsyncClient, url: str, body: dict | bytes, stream: bool,
                       timeout: float | None = None) -> Result:
    """A dict `body` is sent as JSON, bytes as they are (the soak's malformed bodies). `timeout` overrides the
    client's for this request (the soak's impatient clients)."""
    res = Result(t_start=time.perf_counter())
    sent = ({"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes)
            else {"json": body})
    extra = {} if timeout is None else {"timeout": timeout}
    try:
        async with client.stream("POST", url, **sent, **extra) as resp:
            res.status = resp.status_code
            if resp.status_code >= 400:
                text = res.error_body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {_error_message(text)}"
            elif stream:
                usage = await _read_sse(resp, res)
            else:
                usage = json.loads(await resp.aread()).get("usage") or {}
        if res.error is None:
            res.prompt_tokens = usage.get("prompt_tokens")
            completion = usage.get("completion_tokens")
            # No usage sent: count one token per content chunk, a lower bound.
            res.completion_tokens = completion if completion is not None else len(res.chunk_times)
    except Exception as exc:  # noqa: BLE001 - a benchmark reports failures, it does not die on them
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    res.t_end = time.perf_counter()
    return res


def _stats(values: list[float]) -> dict:
    mean = sum(values) / len(values) if values else None
    return {"mean": mean, "p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "n": len(values)}


def summarize(results: list[Result], wall: float, config: dict) -> dict:
    """Turn per-request measurements into the report dict (pure; no I/O)."""
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    # chunk_times is empty for non-streaming requests, so TTFT/ITL/gaps come out empty there.
    ttft = [r.chunk_times[0] - r.t_start for r in ok if r.chunk_times]
    itl_tok = [(r.chunk_times[-1] - r.chunk_times[0]) / (r.completion_tokens - 1)
               for r in ok if len(r.chunk_times) >= 2 and (r.completion_tokens or 0) > 1]
    gaps = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    per_stream = [r.completion_tokens / (r.t_end - r.t_start) for r in ok
                  if r.completion_tokens and r.t_end > r.t_start]
    total_out = sum(r.completion_tokens or 0 for r in ok)
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return {
        "config": config,
        "requests": {"total": len(results), "succeeded": len(ok), "failed": len(errors)},
        "errors": {"count": len(errors), "messages": errors[:5]},
        "wall_time_s": wall,
        "request_throughput_rps": len(ok) / wall if wall > 0 else None,
        "prompt_tokens_mean": sum(prompt) / len(prompt) if prompt else None,
        "completion_tokens_total": total_out,
        "latency_s": _stats([r.t_end - r.t_start for r in ok]),
        "ttft_s": _stats(ttft),
        "itl_per_token_s": _stats(itl_tok),
        "chunk_gap_s": _stats(gaps),
        "output_tokens_per_s": {"per_stream": _stats(per_stream),
                                "aggregate": total_out / wall if wall > 0 else None},
    }


def chat_url(args) -> str:
    base = args.url.rstrip("/")
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


def chat_request(args, prompt: str, max_tokens: int, temperature: float | None) -> dict:
    body = {"model": args.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": args.stream}
    if temperature is not None:
        body["temperature"] = temperature
    if args.stream:
        body["stream_options"] = {"include_usage": True}
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body


async def _run_async(args, prompts: list[str], max_tokens: list[int] | None = None) -> tuple[list[Result], float]:
    """`max_tokens`: each request's own (the mixed workload), else args.max_tokens for all."""
    url = chat_url(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    temperature = parse_temperature(getattr(args, "temperature", "0"))
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), headers=headers, limits=limits) as client:
        async def task(prompt: str, limit: int) -> Result:
            async with sem:
                return await _one_request(client, url, chat_request(args, prompt, limit, temperature), args.stream)

        t0 = time.perf_counter()
        limits_ = max_tokens or [args.max_tokens] * len(prompts)
        results = await asyncio.gather(*(task(p, n) for p, n in zip(prompts, limits_)))
        return list(results), time.perf_counter() - t0


def parse_temperature(value: str | float | None) -> float | None:
    """`none` leaves temperature out of the request, so the server samples with the model's own defaults."""
    if value is None or str(value).lower() == "none":
        return None
    try:
        return float(value)
    except ValueError:
        raise SystemExit(f"error: --temperature: expected a number or 'none', got {value!r}") from None


def _fmt(v, unit: str = "", scale: float = 1.0) -> str:
    return "-" if v is None else f"{v * scale:.2f}{unit}"


def print_table(r: dict) -> None:
    c, ps = r["config"], r["output_tokens_per_s"]["per_stream"]
    print(f"\nbench serve: {c['model']} @ {c['url']}  stream={c['stream']}  concurrency={c['concurrency']}"
          f"  prompt~{c['prompt_len']}  max_tokens={c['max_tokens']}")
    rows = [
        ("requests ok / failed", f"{r['requests']['succeeded']} / {r['requests']['failed']}"),
        ("wall time", _fmt(r["wall_time_s"], " s")),
        ("request throughput", _fmt(r["request_throughput_rps"], " req/s")),
        ("prompt tokens (mean, measured)", _fmt(r["prompt_tokens_mean"])),
        ("completion tokens (total)", str(r["completion_tokens_total"])),
        ("output tok/s aggregate", _fmt(r["output_tokens_per_s"]["aggregate"])),
        ("output tok/s per stream mean / p50", f"{_fmt(ps['mean'])} / {_fmt(ps['p50'])}"),
    ]
    for name, key in [("latency", "latency_s"), ("TTFT", "ttft_s"), ("ITL per token", "itl_per_token_s"),
                      ("chunk gap", "chunk_gap_s")]:
        rows.append((f"{name} p50 / p99", f"{_fmt(r[key]['p50'], ' ms', 1e3)} / {_fmt(r[key]['p99'], ' ms', 1e3)}"))
    width = max(len(n) for n, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    for msg in r["errors"]["messages"]:
        print(f"  error: {msg}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (with or without /v1)")
    parser.add_argument("--model", required=True, help="model id sent in the request body")
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    parser.add_argument("--requests", type=int, default=16, help="total requests")
    parser.add_argument("--prompt-len", type=int, default=256, help="approximate prompt length in tokens")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request")
    parser.add_argument("--stream", action="store_true", help="stream (SSE); needed for TTFT and ITL")
    parser.add_argument("--temperature", default="0",
                        help="sent with every request (default 0: greedy); 'none' uses the server's model defaults")
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="do not send ignore_eos (for servers that reject unknown fields)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    parser.add_argument("--seed", type=int, default=0, help="prompt selection seed")
    parser.add_argument("--mixed", action="store_true",
                        help=f"mixed workload: each prompt {MIXED_PROMPT_LENS[0]}-{MIXED_PROMPT_LENS[1]} tokens and "
                             f"each answer up to {MIXED_MAX_TOKENS[1]} tokens, drawn per request from --seed "
                             "(ignores --prompt-len and --max-tokens)")
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer for exact prompt lengths (optional)")
    parser.add_argument("--out", default=None, help="JSON path (default bench-results/serve-<timestamp>.json)")


def run(args) -> dict:
    """Run the benchmark described by parsed `args`; print a table, write JSON, return the result."""
    result = measure(args)
    out = Path(args.out or f"bench-results/serve-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False))
    print_table(result)
    print(f"  wrote {out}")
    return result


def measure(args, prompts: list[str] | None = None) -> dict:
    """Send the load described by `args` and return the report dict (nothing printed or written). `prompts`, when
    given, are sent as they are instead of built from the passages (bench compare's prompt lengths)."""
    max_tokens = None
    if prompts is None:
        count_tokens = tokenizer_counter(args.tokenizer) if getattr(args, "tokenizer", None) else None
        if getattr(args, "mixed", False):
            prompts, max_tokens = mixed_workload(args.requests, args.seed, count_tokens)
        else:
            prompts = [build_prompt(args.prompt_len, args.seed + i, count_tokens) for i in range(args.requests)]
    results, wall = asyncio.run(_run_async(args, prompts, max_tokens))
    config = {k: getattr(args, k, None) for k in
              ("url", "model", "concurrency", "requests", "prompt_len", "max_tokens", "stream", "ignore_eos", "seed",
               "temperature", "mixed")}
    return summarize(results, wall, config)
