"""`python -m benchmarks generate`: batch-1 decode speed of our loop vs `model.generate()`, and the memory floor.

At batch 1 every decode step reads every weight once, so no implementation can beat
    floor tokens/s = measured memory read bandwidth / bytes read per step (weights + this request's KV cache).
We measure the bandwidth here, on the same machine and in the same run, rather than quoting a datasheet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks import record
from app.config import Settings
from app.core.generate import generate
from app.core.runner.forward import forward
from app.core.sequence import Sequence
from app.models.loading import load_model
from app.models.prepack import PackedLinear, decode_bytes_per_step
from app.core.sampling import SamplingParams

LINEAR_OPS = ("linear", "mm", "int4", "int8", "quantized", "mkldnn", "onednn")  # after ATTENTION_OPS: bmm is theirs
ATTENTION_OPS = ("attention", "softmax", "bmm")
PROMPT = "Which city is the capital of France? Answer, then describe the city in a few paragraphs."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: $MODEL or the embedded default")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--prepack", nargs="?", const="true", choices=("auto", "true", "false"),
                        help="CPU: prepacked linear weights (bf16) or fp32 copies for batched rows, as the "
                             "server runs (default: auto)")
    parser.add_argument("--no-prepack", dest="prepack", action="store_const", const="false")
    parser.add_argument("--quant-variant", action=argparse.BooleanOptionalAction, default=True,
                        help="also time our loop with QUANT=int8 (app/models/quant.py; default: on)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per contender (best is reported)")
    parser.add_argument("--kv-streams", type=int, default=8, help="sequences for the KV-memory check (0 skips it)")
    parser.add_argument("--kv-tokens", type=int, default=1024, help="prompt tokens per sequence in that check")
    parser.add_argument("--quant", default=None, help="QUANT for our loop's model (default: $QUANT, or none)")
    parser.add_argument("--profile", type=int, default=0, help="also profile this many decode steps of our loop: "
                        "where a step's time goes")
    parser.add_argument("--out", default=None, help="also write the figures as JSON here")


def measure_read_bandwidth(n_bytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
    """Bytes/s for a pure read (a sum over a buffer larger than any cache) and for a copy (read + write)."""
    buffer = torch.ones(n_bytes // 4, dtype=torch.float32)
    target = torch.empty_like(buffer)
    buffer.sum(), target.copy_(buffer)  # fault the pages in before timing

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    read_s = best(lambda: buffer.sum())
    copy_s = best(lambda: target.copy_(buffer))
    return {"read_GBps": n_bytes / read_s / 1e9, "copy_GBps": 2 * n_bytes / copy_s / 1e9}


def time_our_loop(lm, prompt_ids: list[int], max_tokens: int) -> tuple[float, float]:
    """(time to first token, decode tokens/s after the first) for `generate()` itself, greedy, EOS ignored."""
    params = SamplingParams(max_tokens=max_tokens, do_sample=False, ignore_eos=True)
    start = time.perf_counter()
    events = generate(lm.model, lm.tokenizer, prompt_ids, params, lm.eos_ids, lm.max_context)
    next(events)  # the first token: the prefill and one choice
    first = time.perf_counter()
    n = 1 + sum(1 for _ in events)
    end = time.perf_counter()
    return first - start, (n - 1) / (end - first)


@torch.inference_mode()
def time_hf_generate(lm, prompt_ids: list[int], max_tokens: int) -> tuple[float, float]:
    """The same measurement for transformers' generate(): TTFT from a 1-token run, decode rate from the rest."""
    ids = torch.tensor([prompt_ids], device=lm.device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    lm.model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    lm.model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kwargs)
    total = time.perf_counter() - start
    return ttft, (max_tokens - 1) / max(total - ttft, 1e-9)


def profile_decode(lm, prompt_ids: list[int], steps: int) -> dict[str, float]:
    """Milliseconds of a decode step under torch.profiler by where they go: the linears' kernels, attention's, the
    other ops', and the rest, outside any op (Python, the loop, dispatch, and the profiler's own cost); apart, the
    lm_head's ops (its matmul and all around it); and the step timed without it. Our int4 kernel and the head are
    labelled for it."""
    from app.models.int4_decode import Int4Kernel

    def labelled(name: str, call):
        def run(*args, **kwargs):
            with torch.profiler.record_function(name):
                return call(*args, **kwargs)
        return run

    def decode() -> float:
        params = SamplingParams(max_tokens=steps + 1, do_sample=False, ignore_eos=True)
        events = generate(lm.model, lm.tokenizer, prompt_ids, params, lm.eos_ids, lm.max_context)
        next(events)  # the prefill and first token, not counted
        start = time.perf_counter()
        n = sum(1 for _ in events)
        return (time.perf_counter() - start) * 1e3 / n

    alone, matmul, head = decode(), Int4Kernel.matmul, lm.model.get_output_embeddings()
    Int4Kernel.matmul, head.forward = labelled("int4_matmul", matmul), labelled("lm_head", head.forward)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            profiled = decode()
    finally:
        Int4Kernel.matmul = matmul
        del head.forward  # the class's again
    split = {"linears": 0.0, "attention": 0.0, "other ops": 0.0}
    for event in prof.key_averages():
        if event.key == "lm_head":  # a label: its self time is the Python around the head's ops
            continue
        name = event.key.lower()
        kind = ("attention" if any(k in name for k in ATTENTION_OPS) else
                "linears" if any(k in name for k in LINEAR_OPS) else "other ops")
        split[kind] += event.self_cpu_time_total / 1e3 / steps  # microseconds over the steps -> ms a step
    head_ms = sum(e.cpu_time_total for e in prof.key_averages() if e.key == "lm_head") / 1e3 / steps
    return {"linears": split["linears"], "lm_head's ops": head_ms, "attention": split["attention"],
            "other ops": split["other ops"], "outside any op": profiled - sum(split.values()),
            "step, profiled": profiled, "step, not profiled": alone}


def run(args: argparse.Namespace) -> dict:
    given = {k: getattr(args, k) for k in ("model", "device", "dtype", "prepack", "quant")
             if getattr(args, k, None) is not None}
    settings = Settings(**given)
    lm = load_model(settings.model, settings.device, settings.dtype, settings.model_cache, prepack=settings.prepack,
                    quant=settings.quant)
    torch.set_grad_enabled(False)
    prompt_ids = lm.encode_chat([{"role": "user", "content": PROMPT}])
    cfg = lm.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * lm.dtype.itemsize
    mean_context = len(prompt_ids) + args.max_tokens / 2
    weight_bytes = decode_bytes_per_step(lm.model)
    bytes_per_step = weight_bytes + kv_bytes_per_token * mean_context
    measure_bandwidth = measure_read_bandwidth if lm.device.type == "cpu" else measure_gpu_bandwidth

    # Contenders: our loop as served, and transformers' generate() on the weights as transformers loads them.
    # With prepacked weights (app/prepack.py) we also run both on the plain weights, so the loop's own share
    # and prepacking's are told apart.
    prepacked = any(isinstance(m, PackedLinear) for m in lm.model.modules())
    plain = load_model(settings.model, settings.device, str(lm.dtype).removeprefix("torch."), settings.model_cache,
                       prepack=False) if prepacked else lm
    contenders = {"ours": (time_our_loop, lm), "hf_generate": (time_hf_generate, plain)}
    if prepacked:
        contenders |= {"ours_plain": (time_our_loop, plain), "hf_generate_prepacked": (time_hf_generate, lm)}
    if getattr(args, "quant_variant", True):  # the int8 variant: not exact, its quality is `bench quality`'s
        int8 = load_model(settings.model, settings.device, "auto", settings.model_cache, quant="int8")
        contenders["ours_int8"] = (time_our_loop, int8)
    result = {
        **record.envelope("generate", args), "model": lm.name, "device": str(lm.device), "dtype": str(lm.dtype), "prepacked": prepacked,
        "prompt_tokens": len(prompt_ids), "max_tokens": args.max_tokens, "weight_bytes_per_step": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token, "bytes_per_decode_step": int(bytes_per_step),
    }
    for timer, model in contenders.values():
        timer(model, prompt_ids, 4)  # warm-up: first-call allocations and kernel selection
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    bandwidths = []
    # Round-robin, bandwidth included: a shared machine has slow and fast spells (we saw memory bandwidth
    # swing between 47 and 76 GB/s from one minute to the next), and each should hit every contender and the floor.
    for _ in range(args.repeats):
        bandwidths.append(measure_bandwidth())
        for name, (timer, model) in contenders.items():
            runs[name].append(timer(model, prompt_ids, args.max_tokens))
    bandwidths.append(measure_bandwidth())
    # The best of each: the floor is an upper bound, so it takes the fastest memory seen in the run.
    result["read_GBps"] = max(b["read_GBps"] for b in bandwidths)
    result["copy_GBps"] = max(b["copy_GBps"] for b in bandwidths)
    result["floor_tokens_per_s"] = result["read_GBps"] * 1e9 / bytes_per_step
    for name, timings in runs.items():
        result[f"{name}_tokens_per_s"] = max(r for _, r in timings)
        result[f"{name}_ttft_s"] = statistics.median(t for t, _ in timings)
    result["ours_vs_hf"] = result["ours_tokens_per_s"] / result["hf_generate_tokens_per_s"]
    result["ours_vs_floor"] = result["ours_tokens_per_s"] / result["floor_tokens_per_s"]
    if getattr(args, "profile", 0):
        result["profile_ms_per_step"] = profile_decode(lm, prompt_ids, args.profile)
    if args.kv_streams:
        result.update(measure_kv_memory(lm, args.kv_streams, args.kv_tokens, kv_bytes_per_token))
    print_report(result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def measure_kv_memory(lm, streams: int, tokens: int, kv_bytes_per_token: int) -> dict[str, float]:
    """Prefill `streams` requests of `tokens` tokens and add up what their caches actually hold."""
    params = SamplingParams(max_tokens=1, do_sample=False)
    seqs = []
    for i in range(streams):
        ids = [(i * 7919 + j * 104729) % lm.vocab_size for j in range(tokens)]  # varied, any valid id
        seq = Sequence(lm.model, lm.tokenizer, ids, params, lm.eos_ids, lm.max_context)
        while seq.prefilling:  # chunked, as the engine does
            forward(lm.model, [(seq, min(512, seq.prompt_len - seq.cache.get_seq_length()))])
        seqs.append(seq)
    held = sum(t.numel() * t.element_size() for s in seqs for layer in s.cache.layers
               for t in (layer.keys, layer.values))
    theory = streams * tokens * kv_bytes_per_token
    return {"kv_streams": streams, "kv_tokens_each": tokens, "kv_bytes_held": held, "kv_bytes_theory": theory,
            "kv_overhead": held / theory - 1}


def measure_gpu_bandwidth(n_bytes: int = 4 << 30) -> dict[str, float]:
    buffer = torch.ones(n_bytes // 4, dtype=torch.float32, device="cuda")
    target = torch.empty_like(buffer)
    buffer.sum(), target.copy_(buffer)
    torch.cuda.synchronize()
    times = {}
    for name, fn in (("read", lambda: buffer.sum()), ("copy", lambda: target.copy_(buffer))):
        start = time.perf_counter()
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        times[name] = (time.perf_counter() - start) / 10
    return {"read_GBps": n_bytes / times["read"] / 1e9, "copy_GBps": 2 * n_bytes / times["copy"] / 1e9}


def print_report(r: dict) -> None:
    print(f"model {r['model']} on {r['device']} ({r['dtype']}), prompt {r['prompt_tokens']} tokens, "
          f"{r['max_tokens']} new tokens")
    print(f"weights read per decode step {r['weight_bytes_per_step'] / 1e9:.3f} GB (the input embedding table "
          f"excluded: one row is read) + KV {r['kv_bytes_per_token'] / 1e3:.1f} kB/token "
          f"-> {r['bytes_per_decode_step'] / 1e9:.3f} GB")
    print(f"memory: read {r['read_GBps']:.1f} GB/s, copy {r['copy_GBps']:.1f} GB/s "
          f"-> floor {r['floor_tokens_per_s']:.1f} tokens/s at batch 1")
    rows = {"ours": "our loop", "ours_plain": "our loop, plain weights", "hf_generate": "model.generate()",
            "hf_generate_prepacked": "generate(), prepacked", "ours_int8": "our loop, QUANT=int8"}
    if r["prepacked"]:
        rows["ours"], rows["hf_generate"] = "our loop, prepacked", "model.generate(), plain"
    print(f"{'':26}{'decode tok/s':>14}{'TTFT s':>10}")
    for key, label in rows.items():
        if f"{key}_tokens_per_s" in r:
            print(f"{label:26}{r[f'{key}_tokens_per_s']:>14.2f}{r[f'{key}_ttft_s']:>10.3f}")
    print(f"ours / generate(): {r['ours_vs_hf']:.2f}x   ours / floor: {r['ours_vs_floor']:.0%}")
    if profile := r.get("profile_ms_per_step"):
        print("a decode step of our loop, ms: " + ", ".join(f"{k} {v:.2f}" for k, v in profile.items()))
    if "kv_bytes_held" in r:
        print(f"KV cache, {r['kv_streams']} streams x {r['kv_tokens_each']} tokens: {r['kv_bytes_held'] / 2**20:.1f} MiB "
              f"held vs {r['kv_bytes_theory'] / 2**20:.1f} MiB theory ({r['kv_overhead']:+.1%})")
