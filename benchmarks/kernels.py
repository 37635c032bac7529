"""`python -m benchmarks kernels`: one linear layer of the model in each weight format torch offers this CPU.

Whether a 4-bit path is worth building is a question about one kernel: a decode step is ~170 linears, each reading
its weight once. For the model's own layers (the MLP's up and down projections of one layer, and lm_head) and a few
row counts (1 and 8 are decode steps, 128 a prefill chunk), this times each format round-robin, so a neighbour's
load hits all alike, and reports the median:
- fp32 and bf16 `F.linear` (the defaults' kernels);
- int8: QUANT=int8's kernels (app/models/quant.py): dynamic (fbgemm / oneDNN) and weight-only;
- int4, weight-only, group-wise asymmetric (`aten._weight_int4pack_mm_for_cpu`), with bf16 and with fp32 activations.
It also reports how far each format's output is from fp32's on the same random activations, and for int4 how far the
re-quantized weight is from the loaded one: the embedded models were dequantized from a Q4_K_M GGUF, whose Q4_K
tensors are already an affine 4-bit grid of 32 weights, and whose Q6_K tensors are not.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from app.config import Settings
from app.models.cpu import cpu_features
from app.models.loading import load_model
from app.models.quant import DynamicInt8Linear, WeightOnlyInt8Linear, dynamic_int8_supported
from app.models.quant_int4 import int4_weight


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="embedded name or local dir")
    parser.add_argument("--layers", default="model.layers.0.mlp.up_proj,model.layers.0.mlp.down_proj,lm_head",
                        help="comma-separated names of the model's linear layers")
    parser.add_argument("--rows", default="1,8,128", help="comma-separated row counts (tokens in one call)")
    parser.add_argument("--group-sizes", default="32,128", help="int4 group sizes, comma-separated")
    parser.add_argument("--trials", type=int, default=20, help="round-robin trials per layer and row count")
    parser.add_argument("--out", default=None, help="also write the figures as JSON here")


def formats(linear: nn.Module, groups: list[int]) -> dict[str, tuple[Callable, torch.dtype]]:
    """name -> (a function of the activations, the activations' dtype) for every format that runs here.
    `linear`: the layer as the defaults load it (fp32 here; with PREPACK its packed copy for several rows)."""
    w32 = linear.weight.detach().float()
    w16 = w32.to(torch.bfloat16)
    found: dict[str, tuple[Callable, torch.dtype]] = {
        "fp32": (lambda x: F.linear(x, w32), torch.float32),
        "fp32, as the defaults serve it": (linear, torch.float32),
        "bf16": (lambda x: F.linear(x, w16), torch.bfloat16),
    }
    plain = nn.Linear(w32.shape[1], w32.shape[0], bias=False)
    plain.weight = nn.Parameter(w32, requires_grad=False)
    if dynamic_int8_supported(torch.device("cpu"), torch.float32):
        found["int8 dynamic"] = (DynamicInt8Linear(plain), torch.float32)
    found["int8 weight-only"] = (WeightOnlyInt8Linear(plain), torch.float32)
    for group in groups:
        codes, scales_and_zeros, _ = int4_weight(w32, group)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            sz = scales_and_zeros.to(dtype)
            found[f"int4 g{group}, {tag} activations"] = (
                lambda x, p=packed, g=group, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, g, sz), dtype)
    return found


def measure(linear: nn.Module, rows: int, groups: list[int], trials: int) -> dict[str, dict]:
    """Each format's median ms over `trials` round-robin calls on `rows` random rows, and its output's relative
    error against fp32's."""
    x = torch.randn(rows, linear.in_features, generator=torch.Generator().manual_seed(rows))
    runs = formats(linear, groups)
    reference = runs["fp32"][0](x)
    times: dict[str, list[float]] = {name: [] for name in runs}
    errors, wanted = {}, {}
    for name, (fn, dtype) in runs.items():
        start = time.perf_counter()
        out = fn(x.to(dtype)).float()  # also the warm-up: packing and first-call costs stay out of the timing
        # a format that takes seconds a call (a fallback kernel) gets 3 trials, so one bench stays minutes long
        wanted[name] = trials if time.perf_counter() - start < 0.5 else min(trials, 3)
        errors[name] = ((out - reference).norm() / reference.norm()).item()
    for trial in range(trials):
        for name, (fn, dtype) in runs.items():
            if trial >= wanted[name]:
                continue
            xd = x.to(dtype)
            start = time.perf_counter()
            fn(xd)
            times[name].append(time.perf_counter() - start)
    return {name: {"ms": 1e3 * statistics.median(t), "rel_error": errors[name]} for name, t in times.items()}


def run(args: argparse.Namespace) -> dict:
    torch.set_grad_enabled(False)
    settings = Settings()
    lm = load_model(args.model, "cpu", "float32", settings.model_cache, prepack=settings.prepack)
    modules = dict(lm.model.named_modules())
    groups = [int(g) for g in args.group_sizes.split(",")]
    cpu = cpu_features()
    print(f"# {cpu.name} ({cpu.aten_capability}), {torch.get_num_threads()} torch threads, torch {torch.__version__}; "
          f"median ms of {args.trials} round-robin trials; error: |out - fp32 out| / |fp32 out|")
    results = []
    for name in args.layers.split(","):
        linear = modules.get(name)  # an nn.Linear, or the drop-in that PREPACK put in its place
        if getattr(getattr(linear, "weight", None), "ndim", 0) != 2 or not hasattr(linear, "in_features"):
            raise ValueError(f"--layers: {name!r} is not a linear layer of {args.model}")
        weight = linear.weight.detach().float()
        requantized = {f"int4 g{g}": ((int4_weight(weight, g)[2] - weight).norm() / weight.norm()).item()
                       for g in groups}
        shape = f"{linear.out_features} x {linear.in_features}"
        print(f"\n{name} ({shape}); int4 weight error: "
              + ", ".join(f"{k} {v:.2e}" for k, v in requantized.items()))
        for rows in (int(r) for r in args.rows.split(",")):
            by_format = measure(linear, rows, groups, args.trials)
            results.append({"layer": name, "shape": shape, "rows": rows, "int4_weight_error": requantized,
                            "formats": by_format})
            for fmt, r in by_format.items():
                print(f"  {rows:>4} rows  {fmt:<28}{r['ms']:>10.3f} ms{r['ms'] / by_format['fp32']['ms']:>8.2f}x fp32"
                      f"   error {r['rel_error']:.2e}", flush=True)
    report = {"model": args.model, "platform": platform.machine(), "results": results}
    if args.out:
        from benchmarks import record

        report = {**record.envelope("kernels", args), **report}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return report
