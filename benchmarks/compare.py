"""`python -m benchmarks compare`: simple-serve next to `transformers serve` and llama.cpp, same weights, same load.

It starts each server as its own process on a loopback port: ours (`python -m app serve`), ours with
`QUANT=int8`, `transformers serve` and `transformers serve --continuous-batching`, all on the same model directory
and dtype, and llama.cpp's `llama-server` (benchmarks/llamacpp.py: built once from source) on the embedded model's
own GGUF file, which is what our weights were dequantized from. Then it warms each
up and runs every scenario (1 stream, then N concurrent streams) against each server in turn, round-robin,
so a slow spell of a shared machine does not land on one server only. It prints one table with ratios to ours
and writes all figures as JSON. docs/performance.md's comparison tables come from this command's JSON.

A server whose process dies (llama.cpp's native build died with SIGILL on an AMX VM) is marked crashed
from then on: its column says so, it gets no ratio, and no figure of it is compared, since requests that failed
fast would otherwise read as a win. Which llama.cpp build ran (native or portable, with its flags) is printed and
recorded. TTFT against prompt length, ours and llama.cpp on the same servers, is `bench scaling`'s `--prompt-lens`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks import record, serve as bench_serve
from app.config import DEFAULT_MODEL, Settings
from benchmarks import llamacpp
from benchmarks.processes import free_port, stop
from app.models.fetch import EMBEDDED, fetch_gguf, fetch_model

SERVERS = ("ours", "ours-int8", "ours-int4", "ours-compiled", "ours-invariant", "ours-variant", "llama.cpp",
           "transformers", "transformers-cb")
# Inductor does not compile bf16 prepacked linears (app/core/runner/static_step.py), so the compiled server runs unpacked;
# everything else (prefix cache, speculation) as ours.
COMPILED = ("DECODE_STEP=compiled", "PREPACK=false")
# ours with BATCH_INVARIANT on and off (docs/walkthrough.md): what invariance costs, side by side in one run.
SETTING_ENV = {"ours-compiled": COMPILED, "ours-invariant": ("BATCH_INVARIANT=on",),
               "ours-variant": ("BATCH_INVARIANT=off",)}


MIXED, MIXED_STREAMS = "mixed, 4 streams", 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name or a local HF directory")
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, from {', '.join(SERVERS)}")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--concurrency", type=int, default=8, help="streams in the loaded scenario")
    parser.add_argument("--single-requests", type=int, default=6, help="requests in the 1-stream scenario")
    parser.add_argument("--loaded-requests", type=int, default=32, help="requests in the loaded scenario")
    parser.add_argument("--mixed-requests", type=int, default=0,
                        help="after the scenarios, a mixed workload of this many requests at 4 streams (prompts "
                             "100-1,500 tokens, answers up to 600): total wall time, tokens/s, TTFT p50/p90 per server")
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", default="0", help="0 (default): greedy; 'none': each server's model defaults")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="send ignore_eos, so every answer is max-tokens long (ours only: transformers rejects it)")
    parser.add_argument("--before", default=None, metavar="DIR",
                        help="also serve ours at the defaults from this checkout of an earlier commit (e.g. `git "
                             "worktree add DIR COMMIT`), as the server 'ours-before', to compare a change in one run")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--out", default=None, help="JSON path (default bench-results/compare-<timestamp>.json)")


def server_command(kind: str, model_dir: Path, port: int, args: argparse.Namespace,
                   llama_server: Path | None = None, gguf: Path | None = None) -> list[str]:
    if kind.startswith("ours"):  # ours-before: the same command, run in the --before checkout (see `run`)
        # int8 picks its own activation dtype (fp32 for the dynamic kernel on a CPU); see app/models/quant.py.
        dtype, quant = ("auto", kind[5:]) if kind in ("ours-int8", "ours-int4") else (args.dtype, "none")
        return [*(("env", *SETTING_ENV[kind]) if kind in SETTING_ENV else ()), sys.executable, "-m", "app", "serve",
                "--model", str(model_dir), "--port", str(port), "--device", args.device, "--dtype", dtype,
                "--quant", quant, "--served-model-name", str(model_dir)]
    if kind == "llama.cpp":
        return llamacpp.server_command(llama_server, gguf, port, parallel=args.concurrency)
    transformers_cli = Path(sys.executable).with_name("transformers")
    command = [str(transformers_cli), "serve", str(model_dir), "--device", args.device, "--dtype", args.dtype,
               "--port", str(port), "--host", "127.0.0.1"]
    return command + (["--continuous-batching"] if kind == "transformers-cb" else [])


def parse_list(text: str, allowed, what: str) -> list[str]:
    """A comma-separated option's items, each one of `allowed`; an unknown one or none at all stops the bench."""
    items = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in items if p not in allowed]
    if unknown or not items:
        raise SystemExit(f"error: {what}: unknown {', '.join(unknown) or '(none given)'}; pick from "
                         f"{', '.join(allowed)}")
    return items


class ServerCrashed(RuntimeError):
    """A server's process died: its column is "crashed" from then on."""


def wait_ready(url: str, path: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerCrashed(f"crashed while starting ({llamacpp.describe_exit(proc.returncode)}); see {log}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"error: the server at {url} was not ready after {timeout:.0f} s; see {log}")


def load_args(args: argparse.Namespace, url: str, model_id: str, concurrency: int, requests: int,
              seed: int, mixed: bool = False) -> argparse.Namespace:
    """`seed`: the first prompt's; the warm-up and each scenario take their own, so no scenario repeats a prompt
    that a server's prompt cache (ours, llama.cpp's) has already seen whole."""
    return argparse.Namespace(url=url, model=model_id, concurrency=concurrency, requests=requests,
                              prompt_len=args.prompt_len, max_tokens=args.max_tokens, stream=True,
                              ignore_eos=args.ignore_eos, api_key=None, timeout=600.0, seed=seed, tokenizer=None,
                              temperature=args.temperature, mixed=mixed)


def run(args: argparse.Namespace) -> dict:
    kinds = parse_list(args.servers, SERVERS, "--servers")
    before = before_checkout(args.before)
    if before:
        kinds.insert(kinds.index("ours") + 1 if "ours" in kinds else 0, "ours-before")
    if args.ignore_eos and any(k.startswith("transformers") for k in kinds):
        raise SystemExit("error: --ignore-eos: transformers serve rejects the ignore_eos field (HTTP 422); "
                         "compare with EOS honoured, or pass --servers ours")
    model_dir = fetch_model(args.model, Settings().model_cache) if args.model in EMBEDDED else Path(args.model).expanduser().resolve()
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"error: --model: {model_dir} is not a model directory (no config.json)")
    llama_server, gguf, kinds, llama_build = prepare_llamacpp(args, kinds)
    if not kinds:
        raise SystemExit("error: --servers: no server left to run")
    out = Path(args.out or f"bench-results/compare-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    procs: dict[str, tuple[subprocess.Popen, str]] = {}
    crashed: dict[str, str] = {}  # kind -> how it died
    scenarios = {"1 stream": (1, args.single_requests),
                 f"{args.concurrency} streams": (args.concurrency, args.loaded_requests)}
    if args.mixed_requests > 0:  # the mixed workload: every server gets the same prompts and answer lengths
        scenarios[MIXED] = (MIXED_STREAMS, args.mixed_requests)
    results: dict[str, dict[str, dict]] = {name: {} for name in scenarios}
    try:
        for kind in kinds:
            port = free_port()
            log = out.with_name(f"{out.stem}-{kind}.log")
            # `python -m app` imports the app of its working directory first: ours-before serves the old tree
            proc = subprocess.Popen(server_command(kind, model_dir, port, args, llama_server, gguf), env=env,
                                    stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                    cwd=before["dir"] if kind == "ours-before" else None)
            procs[kind] = (proc, f"http://127.0.0.1:{port}")
            # Ours answers /ready once loaded and warm; the peers have /health (llama.cpp's is 503 while loading).
            try:
                wait_ready(procs[kind][1], "/ready" if kind.startswith("ours") else "/health", proc,
                           args.ready_timeout, log)
            except ServerCrashed as err:
                crashed[kind] = str(err)
        for kind, (proc, url) in procs.items():  # warm-up: first-request costs (transformers' CB manager starts here)
            _measure_unless_crashed(kind, proc, load_args(args, url, str(model_dir), 1, 2, seed=10_000), crashed)
        for index, (name, (concurrency, requests)) in enumerate(scenarios.items()):
            for kind, (proc, url) in procs.items():
                print(f"{name}: {kind} ...", flush=True)
                load = load_args(args, url, str(model_dir), concurrency, requests, seed=1000 * index,
                                 mixed=name == MIXED)
                results[name][kind] = _measure_unless_crashed(kind, proc, load, crashed)
    finally:
        for proc, _ in procs.values():
            stop(proc)
    report = {**record.envelope("compare", args), "model": str(model_dir), "dtype": args.dtype, "device": args.device,
              "results": results, "ratios": ratios(results)}
    if llama_build:
        report["llama.cpp build"] = llama_build
    if before:
        report["ours-before"] = before
    out.write_text(json.dumps(report, indent=2, ensure_ascii=False))
    print_comparison(report)
    if MIXED in results:
        print_mixed(results[MIXED])
    print(f"wrote {out}")
    return report


def before_checkout(path: str | None) -> dict | None:
    """--before: a checkout with the server's package in it, and the commit it is at (None outside git)."""
    if path is None:
        return None
    where = Path(path).expanduser().resolve()
    if not (where / "app" / "__main__.py").is_file():
        raise SystemExit(f"error: --before: {where} is not a checkout of this repository (no app/__main__.py)")
    commit = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True)
    return {"dir": str(where), "commit": commit.stdout.strip() if commit.returncode == 0 else None}


def print_mixed(by_server: dict[str, dict]) -> None:
    """The mixed workload's table: whoever finishes the same work first, and how long first tokens waited."""
    print(f"\n{MIXED}: same prompts and answer lengths for every server")
    print(f"{'server':<18}{'wall s':>9}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p90':>10}")
    for kind, r in by_server.items():
        if "crashed" in r or not r.get("requests", {}).get("succeeded"):
            print(f"{kind:<18}{'failed':>9}")
            continue
        ttft = r["ttft_s"]
        print(f"{kind:<18}{r['wall_time_s']:>9.1f}{r['output_tokens_per_s']['aggregate']:>9.1f}"
              f"{(ttft['p50'] or 0) * 1e3:>8.0f}ms{(ttft['p90'] or 0) * 1e3:>8.0f}ms")


def ratios(results: dict[str, dict[str, dict]]) -> dict:
    """The ratios the docs cite, from the unrounded figures: ours against each peer, ours-int8 against
    llama.cpp, and loaded against one stream."""
    ttft = lambda r: (r or {}).get("ttft_s", {}).get("p50")  # noqa: E731
    div = lambda a, b: a / b if a and b else None  # noqa: E731
    out: dict = {"ours_vs": {}, "int8_vs_llamacpp": {}, "loaded_vs_single_by_server": {}}
    for scenario, by_server in results.items():
        ours = by_server.get("ours")
        out["ours_vs"][scenario] = {k: div(_rate(ours), _rate(r)) for k, r in by_server.items() if k != "ours" and ours}
        if "ours-int8" in by_server and "llama.cpp" in by_server:
            int8, peer = by_server["ours-int8"], by_server["llama.cpp"]
            out["int8_vs_llamacpp"][scenario] = {"tokens_per_s": div(_rate(int8), _rate(peer)),
                                                 "ttft_p50": div(ttft(int8), ttft(peer))}
    if len(results) >= 2:
        single, loaded = list(results.values())[:2]
        out["loaded_vs_single_by_server"] = {k: div(_rate(loaded.get(k)), _rate(r)) for k, r in single.items()}
        if "ours" in single:
            out["loaded_vs_single"] = {"tokens_per_s": out["loaded_vs_single_by_server"]["ours"],
                                       "ttft_p50": div(ttft(loaded.get("ours")), ttft(single["ours"]))}
    return out


def _measure_unless_crashed(kind: str, proc: subprocess.Popen, load: argparse.Namespace,
                            crashed: dict[str, str]) -> dict:
    """The load's figures, or {"crashed": how} once the server's process has died (recorded in `crashed`): a run
    that ended in a crash is not measured, whatever its requests did before."""
    if kind not in crashed:
        figures = bench_serve.measure(load)
        if proc.poll() is None:
            return figures
        crashed[kind] = f"crashed during the run ({llamacpp.describe_exit(proc.returncode)})"
        print(f"{kind} {crashed[kind]}: no figures of it are compared", flush=True)
    return {"crashed": crashed[kind]}


def prepare_llamacpp(args: argparse.Namespace,
                     kinds: list[str]) -> tuple[Path | None, Path | None, list[str], str | None]:
    """Build (once) a llama-server that survives a smoke run on the GGUF, and say which build; when that is
    impossible, drop llama.cpp with a message."""
    if "llama.cpp" not in kinds:
        return None, None, kinds, None
    if args.model not in EMBEDDED:
        why = "llama.cpp skipped: it serves GGUF files, and --model is not an embedded model with one"
    elif missing := llamacpp.missing_tools():  # before fetching a GGUF it could not serve
        why = (f"llama.cpp skipped: {', '.join(missing)} not found (building llama-server needs cmake and a C/C++ "
               "compiler; e.g. apt-get install cmake g++, or pip install cmake)")
    else:
        gguf = fetch_gguf(args.model, Settings().model_cache)
        binary, build, why = llamacpp.ensure_llama_server(Settings().model_cache, gguf)
        if binary is not None:
            print(f"llama.cpp: comparing against the {build} build", flush=True)
            return binary, gguf, kinds, build
    print(why, flush=True)
    return None, None, [k for k in kinds if k != "llama.cpp"], None


def print_comparison(report: dict) -> None:
    print(f"\n{report['model']} ({report['dtype']}, {report['device']})")
    if build := report.get("llama.cpp build"):
        print(f"llama.cpp build: {build}")
    print(f"{'load':<17}{'server':<18}{'tok/s':>8}{'ours/this':>11}{'TTFT p50':>11}{'ITL p50':>10}{'errors':>8}")
    for scenario, by_server in report["results"].items():
        ours = _rate(by_server.get("ours"))
        for kind, r in by_server.items():
            if "crashed" in r:
                print(f"{scenario:<17}{kind:<18}{'crashed':>8}{'-':>11}{'-':>11}{'-':>10}{'-':>8}  {r['crashed']}")
                continue
            rate = _rate(r)
            ratio = f"{ours / rate:.2f}x" if ours and rate else "-"
            ttft, itl = r["ttft_s"]["p50"], r["itl_per_token_s"]["p50"]
            print(f"{scenario:<17}{kind:<18}{rate or 0:>8.1f}{ratio:>11}"
                  f"{'-' if ttft is None else f'{ttft * 1e3:.0f} ms':>11}"
                  f"{'-' if itl is None else f'{itl * 1e3:.1f} ms':>10}{r['errors']['count']:>8}")
    for scenario, by_server in report["results"].items():  # the quantized goals: ours-int8/int4 against llama.cpp
        for kind in ("ours-int8", "ours-int4"):
            ours, peer = by_server.get(kind), by_server.get("llama.cpp")
            if ours and peer and ("crashed" in ours or "crashed" in peer):
                print(f"{scenario}: {kind} / llama.cpp: no comparison, "
                      f"{'llama.cpp' if 'crashed' in peer else kind} crashed")
            elif ours and peer and _rate(peer) and peer["ttft_s"]["p50"]:
                print(f"{scenario}: {kind} / llama.cpp: {_rate(ours) / _rate(peer):.2f}x the "
                      f"tokens/s, {(ours['ttft_s']['p50'] or 0) / peer['ttft_s']['p50']:.2f}x the TTFT p50")
    # the first two scenarios: one stream, then N streams (the mixed workload, when run, comes after them)
    single, loaded = (by_server.get("ours") for by_server in list(report["results"].values())[:2])
    if _rate(single) and _rate(loaded) and single["ttft_s"]["p50"]:
        print(f"ours, loaded vs 1 stream: {_rate(loaded) / _rate(single):.2f}x "
              f"the tokens/s, {loaded['ttft_s']['p50'] / single['ttft_s']['p50']:.2f}x the TTFT p50")


def _rate(result: dict | None) -> float | None:
    """Aggregate output tokens/s, or None for a server that is absent or crashed."""
    if not result or "crashed" in result:
        return None
    return result["output_tokens_per_s"]["aggregate"]
