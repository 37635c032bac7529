"""`python -m benchmarks step`: one decode step, eager (today's packed pass) against DECODE_STEP=compiled.

For each model, dtype and batch size: B sequences are prefilled the same way twice, one set with DynamicCaches
(the eager packed pass, `forward`) and one in the KV pool (app/core/runner/static_step.py). Then rounds alternate:
`--steps` eager steps, then `--steps` compiled steps, so a neighbour's load on a shared machine hits both alike;
the median time per step of each is reported, with each bucket's compile time and how many greedy tokens the two
paths agreed on. Only the forward pass is timed (choosing tokens is the same code for both).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time

import torch

from app.config import Settings
from app.core.runner.packed import enable_packed_batching
from app.core.generate import prefill
from app.core.runner.forward import forward
from app.core.sequence import Sequence
from app.core.runner.kv_pool import KVPool
from app.core.sampling import SamplingParams
from app.core.runner.static_step import StaticDecodeStep
from app.models.loading import load_model

TEXT = "The capital of France is Paris, a city on the Seine known for its museums, cafes and long history. "
VARIANTS = {"inductor": {}, "freezing": {"freezing": True}, "cpp_wrapper": {"cpp_wrapper": True},
            "freezing+cpp_wrapper": {"freezing": True, "cpp_wrapper": True}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct",
                        help="comma-separated embedded names or local dirs")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batches", default="1,8", help="batch sizes (each is its own bucket)")
    parser.add_argument("--variants", default="inductor", help=f"compile options, comma-separated: {list(VARIANTS)}")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8, help="steps per round per path")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="also write the figures as JSON here")


def started(lm, prompt_ids: list[int], batch: int, max_tokens: int) -> list[Sequence]:
    params = SamplingParams(max_tokens=max_tokens, do_sample=False, ignore_eos=True)
    seqs = [Sequence(lm.model, lm.tokenizer, prompt_ids, params, (), lm.max_context) for _ in range(batch)]
    for seq in seqs:
        seq.choose(prefill(lm.model, seq))
    return seqs


def timed_steps(run, seqs: list[Sequence], steps: int) -> list[float]:
    """`steps` decode steps, each timed around the forward pass alone; returns seconds per step."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = run(seqs)
        if logits.is_cuda:  # kernels run asynchronously: the step ends when the GPU is done
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        for seq, row in zip(seqs, logits):
            seq.choose(row[None])
    return times


def measure(lm, variant: str, batches: list[int], args) -> list[dict]:
    prompt_ids = lm.encode_text(TEXT * (args.prompt_len // 20 + 1))[: args.prompt_len]
    max_tokens = args.steps * args.rounds + 1
    block_size = 16
    pool = KVPool(lm.model.config, max(batches) * (-(-(args.prompt_len + max_tokens + 1) // block_size)) + 1,
                  block_size, lm.dtype, lm.device)
    step = StaticDecodeStep(lm.model, pool, max(batches), lm.max_context, compile=True, options=VARIANTS[variant],
                            buckets=batches)
    step.warm_up()
    eager_run = lambda seqs: forward(lm.model, [(seq, 1) for seq in seqs])  # noqa: E731
    rows = []
    for batch in batches:
        eager_seqs, pooled_seqs = (started(lm, prompt_ids, batch, max_tokens) for _ in range(2))
        eager, compiled = [], []
        for _ in range(args.rounds):
            eager += timed_steps(eager_run, eager_seqs, args.steps)
            compiled += timed_steps(step.run, pooled_seqs, args.steps)
        first = lambda seq: seq.token_ids[0, seq.prompt_len : seq.length].tolist()  # noqa: E731
        same = sum(a == b for a, b in zip(first(eager_seqs[0]), first(pooled_seqs[0])))
        rows.append({"batch": batch, "variant": variant, "compile_s": round(step.compile_seconds[batch], 1),
                     "eager_ms": 1e3 * statistics.median(eager), "compiled_ms": 1e3 * statistics.median(compiled),
                     "same_greedy_tokens": f"{same}/{eager_seqs[0].n_generated}"})
    for row in rows if step.graphs is not None else ():  # compiled steps that replayed a captured CUDA graph
        row["graph_replay_share"] = step.graphs.replays / max(1, step.steps)
    torch._dynamo.reset()  # the next variant or model compiles afresh
    return rows


def memory_floor(lm) -> dict:
    """The memory-bandwidth floor of a decode step: every weight read once per step, whatever the batch (the KV
    cache of a 128-token prompt is left out: ~1% of the default model's weights), at this device's best read
    bandwidth. tokens/s at batch B can reach at most B x bandwidth / bytes."""
    from benchmarks.generate import measure_gpu_bandwidth, measure_read_bandwidth
    from app.models.prepack import decode_bytes_per_step

    bandwidth = (measure_gpu_bandwidth() if lm.device.type == "cuda" else measure_read_bandwidth())["read_GBps"]
    return {"weight_bytes_per_step": decode_bytes_per_step(lm.model), "read_GBps": bandwidth}


def with_floor(row: dict, floor: dict) -> dict:
    steps_per_s = floor["read_GBps"] * 1e9 / floor["weight_bytes_per_step"]
    row.update(floor_tokens_per_s=row["batch"] * steps_per_s, read_GBps=floor["read_GBps"],
               eager_tokens_per_s=row["batch"] * 1e3 / row["eager_ms"],
               compiled_tokens_per_s=row["batch"] * 1e3 / row["compiled_ms"])
    return row


def run(args: argparse.Namespace) -> None:
    settings = Settings()
    results = []
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}; a shared machine is noisy: medians of {args.rounds} rounds x {args.steps} steps")
    print(f"{'model':<30}{'dtype':<10}{'variant':<22}{'batch':>6}{'compile s':>11}{'eager ms':>10}"
          f"{'compiled ms':>13}{'speed-up':>10}{'same tokens':>13}")
    for name in args.models.split(","):
        for dtype in args.dtypes.split(","):
            # bf16 prepacked linears do not compile (DECODE_STEP=compiled falls back): both paths run unpacked
            prepack = "false" if dtype == "bfloat16" else settings.prepack
            lm = load_model(name, args.device, dtype, settings.model_cache, prepack=prepack)
            torch.set_grad_enabled(False)
            enable_packed_batching(lm.model)
            floor = memory_floor(lm)
            for variant in args.variants.split(","):
                for row in measure(lm, variant, [int(b) for b in args.batches.split(",")], args):
                    row.update(model=name, dtype=dtype)
                    results.append(with_floor(row, floor))
                    print(f"{name:<30}{dtype:<10}{variant:<22}{row['batch']:>6}{row['compile_s']:>11.1f}"
                          f"{row['eager_ms']:>10.1f}{row['compiled_ms']:>13.1f}"
                          f"{row['eager_ms'] / row['compiled_ms']:>9.2f}x{row['same_greedy_tokens']:>13}",
                          flush=True)
                    replays = (f", {row['graph_replay_share']:.0%} of compiled steps replayed from CUDA graphs"
                               if "graph_replay_share" in row else "")
                    print(f"    tokens/s: eager {row['eager_tokens_per_s']:.1f}, compiled "
                          f"{row['compiled_tokens_per_s']:.1f}; memory floor {row['floor_tokens_per_s']:.0f} "
                          f"({row['compiled_tokens_per_s'] / row['floor_tokens_per_s']:.0%} of it, at "
                          f"{floor['read_GBps']:.0f} GB/s){replays}", flush=True)
            del lm
            gc.collect()
    if args.out:
        from benchmarks import record

        with open(args.out, "w") as f:
            json.dump({**record.envelope("step", args), "device": args.device, "results": results}, f, indent=2)
