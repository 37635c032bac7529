"""CPU, bf16: reorder linear weights once, at load, into oneDNN's blocked layout, where that measures faster.

Why: on the CPU, torch runs a bf16 `F.linear` through oneDNN, which first reorders the [out, in] weight into its
blocked layout, on every call. A decode step is one matrix-vector product per weight, so that reorder costs
as much as the product itself: measured on Qwen2.5-0.5B on an AMD EPYC with AVX512_BF16, the 24 layers' linears
took 36 ms per step plainly and 13 ms prepacked. Reordering once is what PyTorch's inductor (freezing), IPEX and
vLLM's CPU backend do; we do it with the same private op inductor uses.

Where it pays is measured, not assumed (PREPACK=auto, `measure_packing`): on an Intel Xeon with AMX the packed
model was slower than the plain one (a 1,537-token prompt's first token 4.35 s against 3.81 s), likely
because plain bf16 matmuls there already run on oneDNN's AMX kernels (not measured: no AMX CPU was at hand). So at
load each distinct linear shape is timed plain and packed, on the model's own weights, at one decode row and at a
128-row prefill chunk (interleaved rounds), and packed only where the geometric mean of its two speed-ups is at
least PACKED_MIN_SPEEDUP. PREPACK=true packs every layer, PREPACK=false none.

Outputs: where the packed kernel sums as `nn.Linear`'s does (AVX512_BF16 without AMX: both are oneDNN's
brg_matmul:avx512_core_bf16), bit-identical, which keeps our tokens equal to transformers' own. Where oneDNN runs
plain calls on another kernel, the fp32 sums are added in another order, and one that lands near a bf16 rounding
boundary rounds the other way: one bf16 step apart. Capping oneDNN at AVX512_CORE on a Zen 5 did that to 1 of
Qwen2.5-0.5B's 169 linears, which the old exact check left plain ("N linear layers gave different results"; 4 on
the AMX Xeon). So `prepack_linears` bounds the difference by what rounding can do, and counts and logs the layers
that round differently; a wrong kernel misses by far more, and its layer stays plain.

Where it runs: the reorder needs AVX512BW+VL+DQ or AVX-NE-CONVERT (app/models/cpu.py decides from the CPU's
features); should it raise anyway, the model stays plain. A weight tied to the input embedding (SmolLM2's lm_head)
stays plain too: the embedding needs it in the plain layout, so a packed copy would hold it twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from app.models.cpu import cpu_features, prepack_support
from app.models.linears import plain_linears
from app.models.row_check import SPLIT_NAMES, choose_split

log = logging.getLogger("app.models.prepack")


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return prepack_support(device, dtype) is None


class PackedLinear(nn.Module):
    """A drop-in `nn.Linear` (bf16, CPU) whose weight lives only in oneDNN's layout."""

    def __init__(self, linear: nn.Linear, batch_hint: int = 1):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The batch-size hint picks the blocking; 1 (decode) measured fastest here at every size up to 512 rows.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias = linear.bias
        self.weight_bytes = linear.weight.numel() * linear.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features] -> [..., out_features]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _close_to_plain(linear: nn.Linear, packed: PackedLinear) -> bool | None:
    """True if bit-identical to `nn.Linear`, False if within rounding of it, None if further off (a wrong kernel).

    Both kernels sum exact bf16 products in fp32 and round the sum to bf16 once; in another order the fp32 sums
    differ by far less than 1e-4 of the sum of |x * w| (the bound fp32 copies use, app/models/batch_rows.py), and the
    final rounding then moves by at most one bf16 step of the result."""
    # One row (decode) and several rows in a batch (prefill, packed steps), on varied values.
    probe = torch.linspace(-2, 2, 5 * linear.in_features, dtype=linear.weight.dtype).reshape(1, 5, -1)
    exact = True
    for x in (probe[:, :1], probe):
        want, got = linear(x).float(), packed(x).float()
        if torch.equal(want, got):
            continue
        exact = False
        scale = x.float().abs() @ linear.weight.float().abs().T
        if linear.bias is not None:
            scale = scale + linear.bias.float().abs()
        bound = torch.finfo(linear.weight.dtype).eps * want.abs() + 1e-4 * scale
        if not bool(((got - want).abs() <= bound).all()):
            return None
    return exact


class PrepackFailed(RuntimeError):
    """oneDNN refused to reorder a weight on this machine."""


# BATCH_INVARIANT: the batch hints tried in turn, per shape. 1 is the speed choice above; oneDNN's fp32 kernel was
# invariant with 8 and not with 1 on an AVX2 Zen 2 (app/models/batch_rows.py). bf16's is not measured (no native
# bf16 here): `invariant_hints` checks it on the CPU that runs it.
INVARIANT_HINTS = (1, 8)


@torch.no_grad()
def prepack_linears(model: nn.Module, strict: bool = False, only: Callable[[nn.Linear], bool] | None = None,
                    invariant: bool = False, splits: tuple[str, ...] = ("whole",)) -> int:
    """Swap each `nn.Linear` of `model` (or each one `only` accepts) for a `PackedLinear`, in place; returns how many
    were packed.

    If oneDNN refuses a reorder, the layers not yet packed stay plain (one log line), or with `strict` it raises
    `PrepackFailed`. Either way each layer is `nn.Linear` or a `PackedLinear` within rounding of it, so the model
    still runs. With `invariant` (BATCH_INVARIANT) a shape is packed only with a batch hint under which its packed
    kernel, called in one of `splits` (app/models/row_check.py: whole calls, or fixed tiles, which are all that
    app/models/invariance.py lets bf16 run in on a CPU with native bf16), computes a row the same way at any row
    count (`invariant_hints`); otherwise it stays plain, and the check of app/models/invariance.py then goes on from
    `F.linear`.
    """
    packed_count = kept = rounded = tied = 0
    hints = invariant_hints(model, only, splits) if invariant else {}
    for parent, name, child in _packable(model):
        if child is None:
            tied += 1
            continue
        if only is not None and not only(child):
            continue
        choice = hints.get(_shape(child)) if invariant else (1, None)
        if choice is None:
            continue
        try:
            packed = PackedLinear(child, choice[0])
            packed.invariant_split = choice[1]  # BATCH_INVARIANT: how it is called, checked by invariant_hints
        except RuntimeError as err:  # the CPU checks in app/models/cpu.py should make this unreachable
            if strict:
                raise PrepackFailed(f"oneDNN could not reorder a bf16 weight here: {err}") from err
            log.warning("prepack: oneDNN could not reorder a bf16 weight (%s); %d layers stay plain", err,
                        sum(type(m) is nn.Linear for m in model.modules()))
            return packed_count
        same = _close_to_plain(child, packed)
        if same is None:
            kept += 1
            continue
        setattr(parent, name, packed)
        packed_count += 1
        rounded += not same
    if kept:
        log.warning("prepack: %d linear layers gave results further from nn.Linear's than rounding explains, and "
                    "stayed plain", kept)
    if rounded:
        log.info("prepack: %d packed layers round differently from nn.Linear (oneDNN runs another kernel for plain "
                 "calls on this CPU), within one bf16 step", rounded)
    if tied:
        log.info("prepack: %d linear layer(s) share their weight with the input embedding and stay plain", tied)
    log.info("prepack: %d linear layers reordered for oneDNN", packed_count)
    return packed_count


def _shape(linear: nn.Linear) -> tuple[int, int, bool]:
    return linear.out_features, linear.in_features, linear.bias is not None


def invariant_hints(model: nn.Module, only: Callable[[nn.Linear], bool] | None = None,
                    splits: tuple[str, ...] = ("whole",)) -> dict[tuple, tuple[int, str] | None]:
    """Per shape to pack: (batch hint, split), the first of `splits` (fastest first) in which the packed kernel of
    one of INVARIANT_HINTS computes a row the same way at any row count, checked on one layer of the shape
    (app/models/row_check.py); None where none does. On a Zen 5 (bf16, where only tiles run) the 896 x 4864 shape's
    packed kernel was checked in whole calls, which varied with both hints, and the shape stayed plain: F.linear, in
    the same tiles, where the start's own measurement gave 0.40 ms a row against the packed kernel's 0.14. Checked
    in tiles, it passes and stays packed: served with BATCH_INVARIANT=on, 31.3 tok/s at one stream against 26.3
    before, 84.4 against 69.1 at 8 (44.8 and 125.2 with it off; one run, docs/performance.md)."""
    hints: dict[tuple, tuple[int, str] | None] = {}
    for _, _, linear in _packable(model):
        if linear is None or (only is not None and not only(linear)) or _shape(linear) in hints:
            continue
        hints[_shape(linear)] = _first_invariant(linear, splits)
        if hints[_shape(linear)] is None:
            log.info("prepack: a %d x %d layer's packed kernel computes a row differently at different row counts "
                     "here (batch hints %s; %s); that shape stays plain (BATCH_INVARIANT)", linear.out_features,
                     linear.in_features, ", ".join(map(str, INVARIANT_HINTS)),
                     " or ".join(SPLIT_NAMES[split] for split in splits))
    return hints


def _first_invariant(linear: nn.Linear, splits: tuple[str, ...]) -> tuple[int, str] | None:
    """(hint, split) for `invariant_hints`: one packed copy at a time (a 7B lm_head's is 1 GB in bf16)."""
    for split in splits:
        for hint in INVARIANT_HINTS:
            try:
                packed = PackedLinear(linear, hint)
            except RuntimeError:  # refused: prepack_linears says so when it tries
                return None
            if choose_split(packed, linear.in_features, linear.out_features, linear.weight.dtype,
                            splits=(split,))[0] == split:
                return hint, split
    return None


def _packable(model: nn.Module) -> Iterable[tuple[nn.Module, str, nn.Linear | None]]:
    """(parent, name, linear) for each plain `nn.Linear`; linear is None where it shares the input embedding's
    weight."""
    embedded = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    linears = plain_linears(model)[::-1]
    while linears:  # popped, not iterated: a list of them all kept every swapped-out weight alive to the end, and
        # packing then peaked at twice the model (1.5B shape in bf16 on a Zen 4: 5,960 MiB against 3,440 unpacked)
        parent, name, child = linears.pop()
        yield parent, name, None if child.weight.data_ptr() in embedded else child


# A decode row and a prefill chunk (the engine's CPU chunk is 128 tokens); lm_head sees only the rows that sample.
MEASURE_ROWS, HEAD_ROWS = (1, 128), (1, 8)
MEASURE_REPS, MEASURE_LAYERS = 6, 4  # an even count: each kind goes first equally often
# Packed only where it measured this much faster: a tie keeps nn.Linear's own kernel, and so its exact outputs.
PACKED_MIN_SPEEDUP = 1.05


@dataclass(frozen=True)
class PackTiming:
    """One linear shape, timed plain and packed (ms per layer call, the fastest round) at each row count."""
    in_features: int
    out_features: int
    rows: tuple[int, ...]
    plain_ms: tuple[float, ...]
    packed_ms: tuple[float, ...]

    @property
    def speedup(self) -> float:
        """Plain time over packed, geometric mean over the row counts: > 1 where packing pays."""
        ratios = [p / max(q, 1e-9) for p, q in zip(self.plain_ms, self.packed_ms)]
        return math.prod(ratios) ** (1 / len(ratios))

    @property
    def packs(self) -> bool:
        return self.speedup >= PACKED_MIN_SPEEDUP

    def describe(self) -> str:
        rows = ", ".join(f"{p:.3g}/{q:.3g} ms at {r}" for r, p, q in zip(self.rows, self.plain_ms, self.packed_ms))
        return f"{self.in_features}x{self.out_features} plain/packed {rows}: {self.speedup:.2f}x"


@torch.inference_mode()
def measure_packing(model: nn.Module, reps: int = MEASURE_REPS) -> list[PackTiming]:
    """Time each distinct linear shape plain and packed, on up to MEASURE_LAYERS of its own layers in turn (so the
    weights stream from memory as in a step, not from cache): `reps` rounds over every shape, row count and kind,
    after one round that is not counted (oneDNN creates its primitives then).

    Plain and packed take turns going first, since the first small call after a large one waited up to a scheduler
    tick (4 ms) for oneDNN's second thread here. Each figure is the fastest of its rounds: on a busy machine (2
    shared cores here) most rounds of a 0.05 ms call were delayed by 10-30 ms while another process held a core,
    which moved the median too; a delay only ever adds."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    by_shape: dict[tuple[int, int], list[nn.Linear]] = {}
    for _, _, linear in _packable(model):
        if linear is not None:
            by_shape.setdefault((linear.in_features, linear.out_features), []).append(linear)
    trials = []  # (shape, rows, inputs, plain layers, packed layers)
    for shape, layers in by_shape.items():
        layers = layers[:MEASURE_LAYERS]
        try:
            packed = [PackedLinear(layer) for layer in layers]
        except RuntimeError:  # the reorder refused: prepack_linears logs it when it tries
            continue
        rows = HEAD_ROWS if any(layer is head for layer in layers) else MEASURE_ROWS
        xs = [torch.randn(1, r, shape[0], dtype=layers[0].weight.dtype) for r in rows]
        trials.append((shape, rows, xs, layers, packed))
    samples: dict[tuple, list[float]] = {}
    for rep in range(reps + 1):
        for shape, rows, xs, layers, packed in trials:
            for x in xs:
                kinds = (("plain", layers), ("packed", packed))
                for kind, mods in kinds[::-1] if rep % 2 else kinds:  # each goes first in half the rounds
                    start = time.perf_counter()
                    for mod in mods:
                        mod(x)
                    if rep:
                        elapsed = (time.perf_counter() - start) * 1e3 / len(mods)
                        samples.setdefault((shape, kind, x.shape[1]), []).append(elapsed)
    return [PackTiming(*shape, rows, *(tuple(min(samples[shape, kind, r]) for r in rows)
                                       for kind in ("plain", "packed")))
            for shape, rows, *_ in trials]


def decode_bytes_per_step(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every weight once, except the input embedding table (one row)."""
    sizes: dict[int, int] = {}
    table = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for module in model.modules():
        if isinstance(module, nn.Embedding) or module is table:  # a quantized table too (app/models/quant_embedding.py)
            continue
        for p in module.parameters(recurse=False):
            sizes[id(p)] = p.numel() * p.element_size()  # by id: a tied lm_head counts once, as the Linear it is
        if hasattr(module, "weight_bytes"):  # prepacked or int8 (app/models/quant.py): not plain parameters
            sizes[id(module)] = module.weight_bytes
    return sum(sizes.values())


# ---- the choice, kept: measured once per model, CPU and torch, then the same at every start ----

def choice_key(model_name: str, dtype: torch.dtype) -> str:
    """What the measured choice depends on: the model, the CPU (and what torch may use of it), torch and oneDNN."""
    cpu = cpu_features()
    return (f"{model_name}|{cpu.describe()}|{','.join(sorted(cpu.flags))}|torch {torch.__version__}|"
            f"{str(dtype).removeprefix('torch.')}")


def load_choice(path: Path | None, key: str) -> list[PackTiming] | None:
    """The timings measured at an earlier start for this key, or None. An unreadable file is ignored: the choice is
    then measured again."""
    if path is None or not path.is_file():
        return None
    try:
        kept = json.loads(path.read_text()).get(key)
        return None if kept is None else [PackTiming(t["in"], t["out"], tuple(t["rows"]), tuple(t["plain_ms"]),
                                                     tuple(t["packed_ms"])) for t in kept]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        log.warning("prepack: could not read the kept choice in %s; measuring again", path)
        return None


def save_choice(path: Path | None, key: str, timings: list[PackTiming]) -> None:
    """Keep this start's timings for the next starts (best effort: a read-only cache just measures each start)."""
    if path is None:
        return
    try:
        kept = json.loads(path.read_text()) if path.is_file() else {}
        kept[key] = [{"in": t.in_features, "out": t.out_features, "rows": list(t.rows),
                      "plain_ms": list(t.plain_ms), "packed_ms": list(t.packed_ms)} for t in timings]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(kept, indent=1))
        tmp.replace(path)  # atomic: a second server starting at once reads the old file or the new one
    except (OSError, ValueError) as err:
        log.warning("prepack: could not keep the measured choice in %s (%s); the next start measures again",
                    path, err)
