"""`python -m benchmarks invariance`: does a request get the same answer alone and amid others (issue 48)?

A floating-point sum depends on its order, and a kernel may order a row's sums by how many rows share its call
(docs/walkthrough.md, "Why a batch changes the numbers"). So a server can answer the same prompt differently
depending on who else it is serving. This bench measures it through HTTP:

    python -m benchmarks invariance --compare BATCH_INVARIANT=off,on --env QUANT=int8 --rounds 3

It starts our server (one per `--compare` value, one after another; `--env` settings apply to each), builds
`--prompt-lens` prompts (default 8, from 3 to ~2,000 tokens of the model's own tokenizer, cut from serve.py's
fixed passages, each starting at another passage) and runs `--rounds` rounds: each prompt alone (one request at a
time), then all of them at once (each amid the others, of other lengths). Every request asks for `--max-tokens`
tokens (EOS ignored) and their logprobs, greedy unless `--temperature` (then with `--seed`, the same for every
request, so a seeded sample must repeat too).

Each answer is compared with that prompt's first alone answer (round 1: a cold prefix cache), token for token and
logprob for logprob (floats compared exactly, as JSON carries them): the first token that differs, the first
logprob that differs. "amid others" counts the together answers, "alone again" the later rounds' alone answers (the
prefix cache warm, unless PREFIX_CACHE_BYTES=0). `--ops` instead loads the model in this process and names the
first module whose output differs for the same row (benchmarks/invariance_ops.py). JSON: the house envelope
(benchmarks/record.py: the CPU, versions, settings), every answer and every comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from app.config import DEFAULT_MODEL, Settings
from app.models.fetch import EMBEDDED, fetch_model
from benchmarks import compare, record, serve as bench_serve
from benchmarks.processes import free_port, stop

PROMPT_LENS = "3,20,60,150,350,700,1300,2000"
SERVED_NAME = "invariance"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name or a local HF directory")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a server setting for every run, e.g. QUANT=int8, SPECULATIVE=off, PREFIX_CACHE_BYTES=0")
    parser.add_argument("--compare", default=None, metavar="NAME=V1,V2",
                        help="one server per value of this setting, one after another, e.g. BATCH_INVARIANT=off,on")
    parser.add_argument("--prompt-lens", default=PROMPT_LENS, help="the prompts' lengths in tokens (of the user "
                        "message), one prompt each")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (each alone, then all together)")
    parser.add_argument("--max-tokens", type=int, default=200, help="tokens per answer (EOS ignored)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled with --seed")
    parser.add_argument("--seed", type=int, default=1, help="every request's seed when --temperature > 0")
    parser.add_argument("--ops", action="store_true", help="op level, no server: the first module whose output for "
                        "the same row differs alone and packed with the other prompts (decode: --max-tokens steps)")
    parser.add_argument("--kernels", action="store_true", help="kernel level, no model: which linear kernels and "
                        "attention chunkings compute a row the same way at any row count on this machine "
                        "(benchmarks/invariance_kernels.py)")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--keep-answers", choices=("all", "first"), default="all", help="first: keep every "
                        "comparison but, of the answers, only each prompt's first alone one (a full-size run's file "
                        "shrinks to a fifth, for docs/results)")
    parser.add_argument("--out", default=None, help="JSON path (default bench-results/invariance-<timestamp>.json)")


def parse_settings(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """{label: env} for each server to run: the --env pairs, plus one --compare value each."""
    base = dict(pair(item, "--env") for item in args.env)
    if not args.compare:
        return {" ".join(f"{k}={v}" for k, v in base.items()) or "defaults": base}
    name, values = pair(args.compare, "--compare")
    values = [v.strip() for v in values.split(",") if v.strip()]
    if not values:
        raise SystemExit(f"error: --compare: expected NAME=V1,V2, got {args.compare!r}")
    return {f"{name}={value}": {**base, name: value} for value in values}


def pair(item: str, flag: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name.strip():
        raise SystemExit(f"error: {flag}: expected NAME=VALUE, got {item!r}")
    name = name.strip().upper()
    if name.lower() not in Settings.model_fields:
        raise SystemExit(f"error: {flag}: {name} is not a setting (docs/configuration.md lists them)")
    return name, value.strip()


def model_dir(model: str) -> Path:
    path = fetch_model(model, Settings().model_cache) if model in EMBEDDED else Path(model).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise SystemExit(f"error: --model: {path} is not a model directory (no config.json)")
    return path


def build_prompts(tokenizer, lengths: list[int]) -> list[str]:
    """One prompt per length, each that many tokens of the model's tokenizer when encoded alone (a few less where
    the cut fell inside a character): serve.py's passages in a fixed order, prompt i starting at passage i (so
    prompts differ from their first token)."""
    passages = [p for pair_ in zip(bench_serve.PASSAGES_EN, bench_serve.PASSAGES_ZH) for p in pair_]
    def tokens(first: int, count: int) -> list[int]:  # `count` passages from passage `first` on, wrapping round
        text = " ".join(passages[(first + j) % len(passages)] for j in range(count))
        return tokenizer.encode(text, add_special_tokens=False)

    prompts = []
    for i, length in enumerate(lengths):
        count = 1
        while len(ids := tokens(i, count)) < length:
            count += 1
        cut = length  # a cut inside a character may encode to one token more: cut earlier until it does not
        while cut > 1 and len(tokenizer.encode(tokenizer.decode(ids[:cut]), add_special_tokens=False)) > length:
            cut -= 1
        prompts.append(tokenizer.decode(ids[:cut]))
    return prompts


def run(args: argparse.Namespace) -> dict:
    lengths = [int(p) for p in args.prompt_lens.split(",") if p.strip().isdigit() and int(p) > 0]
    if not lengths or args.rounds < 1 or args.max_tokens < 1:
        raise SystemExit("error: --prompt-lens, --rounds and --max-tokens: at least one prompt, round and token")
    out = Path(args.out or f"bench-results/invariance-{time.strftime('%Y%m%d-%H%M%S')}.json")
    if args.kernels:
        from benchmarks import invariance_kernels

        report = {**record.envelope("invariance", args), **invariance_kernels.measure()}
        invariance_kernels.print_report(report)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, ensure_ascii=False))
        print(f"wrote {out}")
        return report
    settings = parse_settings(args)
    path = model_dir(args.model)
    from transformers import AutoTokenizer

    prompts = build_prompts(AutoTokenizer.from_pretrained(path), lengths)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {**record.envelope("invariance", args), "model": str(path), "prompt_lens": lengths, "runs": {}}
    for label, env in settings.items():
        print(f"{label} ...", flush=True)
        if args.ops:
            from benchmarks import invariance_ops

            report["runs"][label] = {"env": env, **invariance_ops.measure(path, env, prompts, args)}
        else:
            with our_server(path, env, out.with_name(f"{out.stem}-{slug(label)}.log"), args.ready_timeout) as url:
                report["runs"][label] = {"env": env, **measure(url, prompts, args)}
        if args.keep_answers == "first":
            keep_first_answers(report)
        out.write_text(json.dumps(report, indent=2, ensure_ascii=False))  # after each run: a later one may fail
    if args.ops:
        from benchmarks import invariance_ops

        invariance_ops.print_report(report)
    else:
        print_report(report)
    print(f"wrote {out}")
    return report


def keep_first_answers(report: dict) -> dict:
    """In place: every comparison stays; of the answers, each prompt's first alone one (the reference, which the
    docs compare across settings)."""
    for run_ in report["runs"].values():
        for p in run_.get("prompts", []):
            if "alone 1" in p.get("answers", {}):
                p["answers"] = {"alone 1": p["answers"]["alone 1"]}
    report["kept_answers"] = "each prompt's first alone answer only"
    return report


def slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "=-_" else "_" for c in label)


@contextmanager
def our_server(path: Path, env: dict[str, str], log: Path, ready_timeout: float):
    port = free_port()
    command = [sys.executable, "-m", "app", "serve", "--model", str(path), "--port", str(port)]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "SERVED_MODEL_NAME": SERVED_NAME, **env}
    proc = subprocess.Popen(command, env=full_env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        compare.wait_ready(url, "/ready", proc, ready_timeout, log)
        yield url
    except compare.ServerCrashed as err:
        raise SystemExit(f"error: the server {err}") from None
    finally:
        stop(proc)


async def ask(client: httpx.AsyncClient, url: str, prompt: str, args: argparse.Namespace) -> dict:
    """One chat completion -> {"tokens": [[text, bytes]], "logprobs": [...], "prompt_tokens"} or {"error"}."""
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
            "temperature": args.temperature, "ignore_eos": True, "logprobs": True}
    if args.temperature > 0:
        body["seed"] = args.seed
    try:
        resp = await client.post(url + "/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    if resp.status_code != 200:
        return {"error": f"HTTP {resp.status_code}: {resp.text[:300]}"}
    answer = resp.json()
    content = answer["choices"][0]["logprobs"]["content"]
    return {"tokens": [[c["token"], c.get("bytes")] for c in content], "logprobs": [c["logprob"] for c in content],
            "prompt_tokens": answer["usage"]["prompt_tokens"]}


async def rounds(url: str, prompts: list[str], args: argparse.Namespace) -> list[dict[str, list[dict]]]:
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        done = []
        for _ in range(args.rounds):
            alone = [await ask(client, url, p, args) for p in prompts]
            together = list(await asyncio.gather(*(ask(client, url, p, args) for p in prompts)))
            done.append({"alone": alone, "together": together})
        return done


def difference(reference: dict, answer: dict) -> dict:
    """Where `answer` departs from `reference`: the first differing token and logprob (None: none differs)."""
    if "error" in reference or "error" in answer:
        return {"error": answer.get("error") or reference.get("error"), "identical": False,
                "first_token_diff": None, "first_logprob_diff": None}
    first = lambda a, b: next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),  # noqa: E731
                              None if len(a) == len(b) else min(len(a), len(b)))
    tokens = first(reference["tokens"], answer["tokens"])
    logprobs = first(reference["logprobs"], answer["logprobs"])
    return {"identical": tokens is None and logprobs is None, "first_token_diff": tokens,
            "first_logprob_diff": logprobs}


def measure(url: str, prompts: list[str], args: argparse.Namespace) -> dict:
    done = asyncio.run(rounds(url, prompts, args))
    per_prompt = []
    for i in range(len(prompts)):
        reference = done[0]["alone"][i]
        compared = {f"together {r + 1}": difference(reference, d["together"][i]) for r, d in enumerate(done)}
        compared |= {f"alone {r + 1}": difference(reference, d["alone"][i]) for r, d in enumerate(done) if r}
        per_prompt.append({"prompt_tokens": reference.get("prompt_tokens"), "compared": compared,
                           "answers": {f"{kind} {r + 1}": d[kind][i] for r, d in enumerate(done)
                                       for kind in ("alone", "together")}})
    return {"prompts": per_prompt, "summary": summary(per_prompt)}


def summary(per_prompt: list[dict]) -> dict:
    def count(kind: str) -> dict:
        diffs = [d for p in per_prompt for name, d in p["compared"].items() if name.startswith(kind)]
        return {"n": len(diffs), "identical": sum(d["identical"] for d in diffs),
                "tokens_identical": sum(d["first_token_diff"] is None and "error" not in d for d in diffs),
                "logprobs_identical": sum(d["first_logprob_diff"] is None and "error" not in d for d in diffs),
                "errors": sum("error" in d for d in diffs)}
    return {"amid_others": count("together"), "alone_again": count("alone")}


def print_report(report: dict) -> None:
    s = report["settings"]
    sampling = f"temperature {s['temperature']}, seed {s['seed']}" if s["temperature"] > 0 else "greedy"
    print(f"\nbench invariance: {report['model']}, {len(report['prompt_lens'])} prompts, {s['rounds']} round(s), "
          f"{s['max_tokens']} tokens each, {sampling} ({report['machine']['cpu']})")
    for label, run_ in report["runs"].items():
        print(f"\n{label}")
        print(f"{'prompt':>6}{'tokens':>8}{'identical':>11}{'first differing token':>23}{'logprobs bit-identical':>24}"
              f"{'first differing logprob':>25}")
        for i, p in enumerate(run_["prompts"]):
            diffs = list(p["compared"].values())
            first = lambda key: min((d[key] for d in diffs if d[key] is not None), default="-")  # noqa: E731
            identical = f"{sum(d['identical'] for d in diffs)} of {len(diffs)}"
            same = sum(d["first_logprob_diff"] is None and "error" not in d for d in diffs)
            same_logprobs = f"{same} of {len(diffs)}"
            print(f"{i + 1:>6}{p['prompt_tokens'] or '-':>8}{identical:>11}{first('first_token_diff'):>23}"
                  f"{same_logprobs:>24}{first('first_logprob_diff'):>25}")
        for kind, c in run_["summary"].items():
            errors = f"; {c['errors']} failed" if c["errors"] else ""
            print(f"{kind.replace('_', ' ')}: {c['identical']} of {c['n']} identical, token for token and logprob "
                  f"for logprob (tokens {c['tokens_identical']} of {c['n']}, logprobs {c['logprobs_identical']} of "
                  f"{c['n']}){errors}")
        for p in run_["prompts"]:
            for name, d in p["compared"].items():
                if "error" in d:
                    print(f"  {name}: {d['error']}")
