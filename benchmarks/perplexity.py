"""`python -m benchmarks perplexity`: a GGUF's perplexity as we serve it, beside `llama-perplexity`'s on the same file.

Both score the same token ids (llama.cpp's own tokenization of the text, from `llama-tokenize`) the way
`llama-perplexity` does: windows of `--ctx` tokens, the first one replaced by BOS where the vocabulary adds one,
each token of a window's second half scored given all before it in that window. Ours runs the engine's pass on the
model as `MODEL=file.gguf` loads it (QUANT=auto: each tensor's own bits), `--chunk` tokens a pass, each pass reading
the earlier ones from the request's own cache: once with the full-width cache and once with KV_CACHE_DTYPE=int8.
The default text is the GNU GPL v3 (benchmarks/data/gpl-3.0.txt, which anyone may copy verbatim): ~8k tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
from collections import Counter
from pathlib import Path

import torch

from app.config import Settings
from app.core.runner.forward import forward
from app.core.runner.kv_store import KEY_GROUP
from app.core.runner.packed import enable_packed_batching
from app.core.sampling import SamplingParams
from app.core.sequence import Sequence
from app.models.loading import load_model
from benchmarks import llamacpp, record

TEXT = Path(__file__).with_name("data") / "gpl-3.0.txt"
FINAL = re.compile(rb"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a .gguf file (default: the embedded default's)")
    parser.add_argument("--text", default=str(TEXT), help="the text to score")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per window, as llama-perplexity's -c")
    parser.add_argument("--chunk", type=int, default=128, help="tokens per pass of ours")
    parser.add_argument("--quant", default=None, help="QUANT for ours (default: $QUANT, or auto: the file's own bits)")
    parser.add_argument("--out", default=None, help="also write the figures as JSON here")


@torch.inference_mode()
def served_perplexity(lm, ids: list[int], ctx: int, chunk: int, bos: int | None, kv_int8: bool) -> float:
    """llama-perplexity's score, through the engine's pass with the request's own cache (8-bit with `kv_int8`)."""
    enable_packed_batching(lm.model)
    first, nll, count = ctx // 2, 0.0, 0
    for start in range(0, len(ids) // ctx * ctx, ctx):
        window = ids[start:start + ctx]
        window[0] = window[0] if bos is None else bos
        seq = Sequence(lm.model, lm.tokenizer, window, SamplingParams(max_tokens=1), lm.eos_ids, ctx + 1,
                       kv_int8=kv_int8)
        for fed in range(0, ctx, chunk):  # logits row k predicts token fed + k + 1
            n = min(chunk, ctx - fed)
            logits = forward(lm.model, [(seq, n)], [n]).float()
            rows = [k for k in range(n) if first <= fed + k < ctx - 1]
            if rows:
                targets = torch.tensor([window[fed + k + 1] for k in rows])
                nll += torch.nn.functional.cross_entropy(logits[rows], targets, reduction="sum").item()
                count += len(rows)
    return math.exp(nll / count)


def llama_tool(binary: Path, name: str) -> Path:
    """`name` from the build that made `binary` (llama-server's), built there if it is missing: a minute or so."""
    tool, build = binary.with_name(name), binary.parents[1]
    if not tool.is_file():
        subprocess.run(["cmake", "--build", str(build), "--target", name, f"-j{os.cpu_count() or 1}"], check=True,
                       stdout=subprocess.DEVNULL)
    return tool


def run(args: argparse.Namespace) -> dict:
    settings = Settings(**({"quant": args.quant} if args.quant else {}))
    gguf = Path(args.model or Path(settings.model_cache) / f"{settings.model}.gguf").expanduser()
    if gguf.suffix != ".gguf" or not gguf.is_file():
        raise SystemExit(f"error: --model: {gguf} is not a .gguf file (the embedded default's appears once "
                         "`python -m app fetch-model` has run)")
    built = [llamacpp.binary_path(settings.model_cache, portable) for portable in (False, True)]
    server, build, why = next(((b, b.parents[1].name, "") for b in built if b.is_file()), (None, "", ""))
    if server is None:  # built as `bench compare` and `bench scaling` build it (and smoke-run) for llama-server
        server, build, why = llamacpp.ensure_llama_server(Path(settings.model_cache), gguf)
    if server is None:
        raise SystemExit(f"error: {why}")
    threads = str(os.cpu_count() or 1)
    tokens = subprocess.run([str(llama_tool(server, "llama-tokenize")), "-m", str(gguf), "-f", args.text, "--ids",
                             "--log-disable"], check=True, capture_output=True, text=True).stdout
    ids = json.loads(tokens.strip().splitlines()[-1])
    print(f"{len(ids)} tokens of {args.text}; llama-perplexity -c {args.ctx} on {threads} threads ...", flush=True)
    found = {}
    for cache in ("f16", "q8_0"):  # its default cache, and its 8-bit one (which needs flash attention)
        llama = subprocess.run([str(llama_tool(server, "llama-perplexity")), "-m", str(gguf), "-f", args.text, "-c",
                                str(args.ctx), "-b", str(args.ctx), "-t", threads, "-fa", "on", "-ctk", cache, "-ctv",
                                cache], capture_output=True)
        found[cache] = FINAL.search(llama.stdout + llama.stderr)
        if not found[cache]:
            raise SystemExit(f"error: llama-perplexity printed no final estimate:\n{llama.stderr.decode()[-3000:]}")
    lm = load_model(str(gguf), "cpu", settings.dtype, settings.model_cache, prepack=settings.prepack,
                    quant=settings.quant, int4_kernel=settings.int4_kernel)  # as `serve` loads it
    bos = lm.tokenizer.bos_token_id if getattr(lm.tokenizer, "add_bos_token", False) else None
    ours = {kv: served_perplexity(lm, ids, args.ctx, args.chunk, bos, kv == "int8") for kv in ("auto", "int8")}
    report = {**record.envelope("perplexity", args), "model": str(gguf), "llama_cpp_build": build,
              "text_tokens": len(ids), "scored_tokens": len(ids) // args.ctx * (args.ctx - 1 - args.ctx // 2),
              "llama_cpp": {"perplexity": float(found["f16"][1]), "plus_minus": float(found["f16"][2]),
                            "perplexity_kv_q8_0": float(found["q8_0"][1])},
              "ours": {"quant": settings.quant, "lm_head": type(lm.model.lm_head).__name__,
                       "linears": dict(Counter(type(m).__name__ for m in lm.model.modules()
                                               if hasattr(m, "in_features") and hasattr(m, "out_features"))),
                       "weight_bytes": lm.weight_bytes, "dtype": str(lm.dtype),
                       "perplexity": ours["auto"], "perplexity_kv_int8": ours["int8"], "kv_int8_key_group": KEY_GROUP}}
    report["ours"]["vs_llama_cpp"] = ours["auto"] / report["llama_cpp"]["perplexity"] - 1
    report["ours"]["kv_int8_vs_cache"] = ours["int8"] / ours["auto"] - 1
    print(f"{gguf.name}, {report['scored_tokens']} tokens scored in windows of {args.ctx}:\n"
          f"  llama-perplexity        {report['llama_cpp']['perplexity']:.4f} +/- {found['f16'][2].decode()}, "
          f"{report['llama_cpp']['perplexity_kv_q8_0']:.4f} with its q8_0 cache\n"
          f"  ours, QUANT={settings.quant:<13}{ours['auto']:.4f} ({report['ours']['vs_llama_cpp']:+.2%} against "
          "llama.cpp)\n"
          f"  ours, KV_CACHE_DTYPE=int8 {ours['int8']:.4f} ({report['ours']['kv_int8_vs_cache']:+.2%} against "
          f"its full-width cache)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report
