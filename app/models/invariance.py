"""BATCH_INVARIANT: a request's numbers do not depend on what else shares its forward pass.

Batching changes floating-point results because a kernel may sum a row's products in another order when the call
has more rows (docs/walkthrough.md shows it on one dot product). With BATCH_INVARIANT on, every op that could see
the batch computes each row the same way at any batch: the answer alone and under load is the same, token for
token and logprob for logprob, and a seeded sample repeats. `resolve_batch_invariant` decides what `auto` means.

The linears (`make_linears_invariant`, after loading has quantized or prepacked them): each runs one kernel for
every row count, one row included, that a load-time check on one layer of each shape found to compute a row the
same way as alone in calls of every count from 1 to 8 rows and of 17, 64 and 129 (a large lm_head: every count
up to fewer, row_check.py CHECK_MACS); no call is wider than its shape's check, a wider one goes in calls of that
many (app/models/row_check.py `split_rows`), so every row count the engine sends the lm_head (prompt-logprob
chunks, verify rows, many streams) is one its check tried. Where the kernel fails, its calls are split into fixed
tiles of rows, or one call per row, which always holds. So a CPU where a kernel is not invariant still gets
invariant answers, only slower. A LoRA adapter's two products are checked and split the same way, at the first
pass that meets their shape (app/models/lora_layers.py). The kernels, and what loading did for them:
- fp32 on a CPU: the engine's passes on oneDNN's packed copy (app/models/batch_rows.py chooses, copy or not);
  outside them (`generate()`, the oracle) `F.linear`, bit for bit `model.generate()`;
- bf16 prepacked in place: only with a batch hint whose packed kernel passes (app/models/prepack.py), else plain;
  on a CPU with native bf16, every bf16 call in fixed tiles (`_half_on_native_cpu`: whole calls varied on an AMX
  Xeon at row counts the check does not sample), the packed kernel too where it passes in them;
- QUANT=int8 dynamic: an anchor row fixes the call's quantization scale (app/models/quant.py DynamicInt8Linear);
  weight-only int8 and int4 as they are; int4 never on the INT4_WIDE_COPY copy. lm_head included.
Measured on this project's AVX2 Zen 2: every one of these passes whole. Checking the default model's six shapes
took 0.7 s of its fp32 load on one thread, 1.0 s on two busy ones, at 1, 2, 3, 8, 17, 64 and 129 rows (the lm_head
at 1, 2, 3 and 8: most of the time is reading it); QUANT=int8 1.7 s, int4 1.0 s. With every count from 1 to 8, on
a Zen 4 EPYC (2 threads of a shared machine, single runs): 0.6 s against 0.4 s before, the lm_head's part 0.43 s
against 0.29 s.

Where BATCH_INVARIANT cannot hold as the engine runs a model (one request per pass: its attention is not packed),
`cannot_hold` refuses `on` and turns `auto` off, so nothing reports it on.
"""

from __future__ import annotations

import itertools
import logging
from collections import defaultdict

import torch
from torch import nn

from app.errors import ConfigError
from app.models.batch_rows import BatchRowsLinear
from app.models.cpu import cpu_features
from app.models.prepack import PackedLinear
from app.models.quant import DynamicInt8Linear, WeightOnlyInt8Linear
from app.models.quant_group8 import GroupInt8Linear
from app.models.quant_int4 import Int4Linear
from app.models.row_check import (CHECK_ROWS, SPLIT_NAMES, SPLITS, RowSplitLinear, choose_split,
                                  rows_to_check)

log = logging.getLogger("app.models.invariance")

INVARIANT_MODES = ("auto", "on", "off")
LINEAR_KINDS = (nn.Linear, BatchRowsLinear, PackedLinear, DynamicInt8Linear, WeightOnlyInt8Linear, Int4Linear,
                GroupInt8Linear)


def resolve_batch_invariant(mode: str, device: torch.device, dtype: torch.dtype = torch.float32, quant: str = "none",
                            decode_step: str = "eager", sharded: bool = False,
                            no_fp32_copies: str | None = None, lora: bool = False) -> tuple[bool, str]:
    """(on?, why) for BATCH_INVARIANT=`mode`. `auto` is on only where its cost was measured at most 10%: on a CPU
    in fp32 without QUANT it cost nothing, it was faster (`bench compare`, Zen 2: 1.30x tokens/s at 1 stream, 1.12x
    at 8: the packed kernel is faster than MKL's for one row, and a decode row's own attention call beats padding
    to the longest row), and /health's p99 under 8 starting streams was the same with it as without (quiet reruns
    of tests/real/test_server_real.py's test). That is with PREPACK's packed fp32 copies: `no_fp32_copies` says why
    they will not be made (app/models/loading.py), and then `auto` is off. Elsewhere `auto` is off, and the reason
    says why.

    `lora` (LORA_MODULES or LORA_RUNTIME_LOADING): each adapter's two products then run in calls checked as the
    linears' are (app/models/lora_layers.py), on this CPU in fixed tiles of 8 rows. Timed on the default model's
    shapes (rank 16 on all seven linears of its 24 layers, random weights, 2 threads of a shared Zen 4 EPYC): +9.5
    ms a one-row step over the plain products (+9% of the linears, head and products: 88 to 99 ms for the linears
    and head on the packed copies, 141 ms on F.linear, which `off` runs for one row), +4.8 ms at 8 rows (+3%), +82
    ms at 128 (+8.5%). Within the 10%, and one stream still runs faster than with `off`: `auto` stays on, and says
    the adapters are covered."""
    if mode not in INVARIANT_MODES:
        raise ValueError(f"batch_invariant must be one of {', '.join(INVARIANT_MODES)}, not {mode!r}")
    adapters = "; LoRA adapters' products in checked calls too" if lora else ""
    if mode != "auto":
        return mode == "on", f"BATCH_INVARIANT={mode}" + (adapters if mode == "on" else "")
    if device.type != "cpu":
        return False, f"auto: off on {device.type} (its cost there is not measured yet)"
    if sharded:
        return False, "auto: off under tensor parallelism (each rank's share of a row is its own kernel's, unchecked)"
    if decode_step == "compiled":
        return False, "auto: off under DECODE_STEP=compiled (it pads decode rows to a batch bucket)"
    if quant != "none":
        return False, (f"auto: off with QUANT={quant} (the dynamic int8 anchor row made a one-row decode step about "
                       "a third slower, Zen 2; BATCH_INVARIANT=on to pay it)")
    if dtype != torch.float32:  # bench compare, Zen 5, bf16: on ÷ off 0.70x tok/s at 1 stream, 0.67x at 8
        return False, (f"auto: off in {str(dtype).removeprefix('torch.')} (on a CPU with native bf16 the linears "
                       "run in fixed tiles: about 30% of tokens/s at 1 and 8 streams on a Zen 5, docs/"
                       "performance.md; BATCH_INVARIANT=on to pay it)")
    if no_fp32_copies:  # every linear would run in tiles of 8 rows: a one-stream step computes 8 (~2.6x here)
        return False, f"auto: off, since {no_fp32_copies} (the linears would run in tiles of 8 rows)"
    return True, f"auto: on (a CPU in fp32: it measured no slower there; docs/performance.md){adapters}"


def cannot_hold(why_on: str, why_not: str) -> str:
    """BATCH_INVARIANT was resolved on (`why_on`), but cannot hold as the engine runs this model (`why_not`). What
    was asked for decides: `on` is refused at start with a ConfigError naming the setting, as PREPACK=true is where
    it cannot work (a promise asked for explicitly is kept or the start fails, never reported kept while broken);
    `auto` turns off and returns its reason, for the log, /ready and /v1/models."""
    if not why_on.startswith("auto:"):
        raise ConfigError(f"BATCH_INVARIANT=on, but {why_not}, so a request's numbers would depend on what else "
                          "runs; set BATCH_INVARIANT=auto (off for this model) or off", param="batch_invariant")
    return f"auto: off, since {why_not}"


def kernel_name(layer: nn.Module) -> str:
    """What computes this linear's rows under BATCH_INVARIANT, for the start log."""
    if isinstance(layer, BatchRowsLinear):
        return "oneDNN packed fp32" if layer.invariant and layer.invariant[0] == "packed" else "F.linear fp32"
    if isinstance(layer, PackedLinear):
        return f"oneDNN packed {str(layer.packed_weight.dtype).removeprefix('torch.')}"
    if isinstance(layer, DynamicInt8Linear):
        return f"dynamic int8 with an anchor row ({layer.engine})"
    if isinstance(layer, WeightOnlyInt8Linear):
        return "weight-only int8"
    if isinstance(layer, GroupInt8Linear):
        return "a GGUF's 8-bit groups"
    if isinstance(layer, Int4Linear):
        return "int4" + (" (its bf16 copy too)" if layer.wide is not None else "")
    return f"F.linear {str(layer.weight.dtype).removeprefix('torch.')}"


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, layer) for each linear of a kind above, listed whole before any swap."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) in LINEAR_KINDS and not isinstance(parent, RowSplitLinear)]


def _device(layer: nn.Module) -> torch.device:
    """Where the layer computes; dynamic int8's weights are a packed object, not a tensor: CPU."""
    tensor = next(itertools.chain(layer.parameters(), layer.buffers()), None)
    return torch.device("cpu") if tensor is None else tensor.device


def _half_on_native_cpu(layer: nn.Module) -> bool:
    """A bf16/fp16 linear on a CPU that multiplies bf16 natively (AVX512_BF16, AMX): it runs in fixed tiles.

    Why not whole calls there: on an AMX Xeon (16 threads, torch 2.11; the retired `benchmarks invariance
    --kernels`, at deca0b0, through the device tool), oneDNN's packed bf16 kernel with batch hint 8 passed at 1 to 64 and 129 rows and
    differed at 65 and 200, and a served random-weight Qwen2.5-0.5B with whole calls still differed under load at
    layer 0's q_proj during a prefill (`--ops`). A check samples row counts; a call of exactly TILE_ROWS rows is
    the same call at every step, so checking each position of a tile covers every call there is. And a check of
    bf16 outputs is weak: the rounding to bf16 hides most differences of summation order. On a Zen 5, plain bf16
    F.linear passed the load check and the kernel bench's 14 row counts, yet a 64 x 64 layer's calls of 2 to 5
    rows differed from the rows alone for 1 random input in 20. What tiles cost: a one-row decode step computes 8
    rows, a 128-row prefill chunk is 16 calls (Zen 5, one 4864 x 896 layer, oneDNN's packed kernel: 0.10 ms for 8
    rows against 0.07 for one, 1.7 ms for 128 rows in tiles against 1.2 whole)."""
    weight = getattr(layer, "packed_weight", None)
    if weight is None:
        weight = getattr(layer, "weight", None)
    return isinstance(weight, torch.Tensor) and tiles_only(weight.dtype, weight.device)


def tiles_only(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether linears of this dtype run only in fixed tiles here under BATCH_INVARIANT (`_half_on_native_cpu`)."""
    return (dtype in (torch.bfloat16, torch.float16) and device.type == "cpu"
            and cpu_features().native_bf16 is not None)


def invariant_splits(dtype: torch.dtype, device: torch.device) -> tuple[str, ...]:
    """The ways a linear of this dtype may be called under BATCH_INVARIANT, before one call per row."""
    return SPLITS[1:-1] if tiles_only(dtype, device) else SPLITS[:-1]


@torch.no_grad()
def make_linears_invariant(model: nn.Module, dtype: torch.dtype, sharded: bool = False) -> str:
    """Give every linear a way to compute a row the same way at any row count: the kernels that loading chose
    and checked keep theirs (fp32's BatchRowsLinear, bf16's PackedLinear); every other kind is checked here, one
    layer per kind and shape, whole calls, then tiles, else one call per row. Every layer but BatchRowsLinear (which
    splits its own calls) is then called through a RowSplitLinear, whole calls too: none wider than its shape's
    check. Returns what runs, for the start log and /ready."""
    if sharded:
        return "linears: not checked (tensor parallel shards: each rank's share of a row is its own kernel's)"
    plans, swaps = {}, []
    counts: dict[tuple[str, str], int] = defaultdict(int)
    shapes: set[tuple[int, int]] = set()
    for parent, name, layer in _linears(model):
        split = layer.invariant[1] if isinstance(layer, BatchRowsLinear) and layer.invariant else None
        split = split or getattr(layer, "invariant_split", None)  # prepacking's check chose it (prepack.py)
        fixed_tiles = _half_on_native_cpu(layer)
        if split is None or (fixed_tiles and split == "whole"):
            key = (type(layer), layer.out_features, layer.in_features, getattr(layer, "bias", None) is not None,
                   getattr(layer, "engine", None))
            if key not in plans:
                plans[key] = choose_split(layer, layer.in_features, layer.out_features, dtype,
                                          splits=SPLITS[1:] if fixed_tiles else SPLITS, device=_device(layer))
                if plans[key][1] is not None:
                    log.info("batch invariance: %s (%d x %d) computes a row differently depending on the call's "
                             "row count (first seen at %d rows); it runs %s", kernel_name(layer), layer.out_features,
                             layer.in_features, plans[key][1], SPLIT_NAMES[plans[key][0]])
            split = plans[key][0]
            layer.invariant_split = split
        if not isinstance(layer, BatchRowsLinear):  # BatchRowsLinear splits its own calls
            swaps.append((parent, name, RowSplitLinear(layer, split)))  # whole calls too: none wider than checked
        counts[kernel_name(layer), split] += 1
        shapes.add((layer.out_features, layer.in_features))
    for parent, name, wrapped in swaps:
        setattr(parent, name, wrapped)
    kinds = "; ".join(f"{kernel}, {SPLIT_NAMES[split]}: {n} layer{'s' * (n != 1)}"
                      for (kernel, split), n in counts.items())
    fewer = [f"{out} x {n_in}: {_counts(rows_to_check(n_in, out))}" for out, n_in in sorted(shapes)
             if len(rows_to_check(n_in, out)) < len(CHECK_ROWS)]
    rows = f"{_counts(CHECK_ROWS)} rows" + (f" ({', '.join(fewer)})" if fewer else "")
    oracle = ("; fp32 in the engine's passes only: generate(), the oracle, stays on F.linear"
              if any(isinstance(layer, BatchRowsLinear) for _, _, layer in _linears(model)) else "")
    return (f"linears: {kinds or 'none'}; each computes a row the same way in a call of {rows} as alone, checked "
            f"here on one layer per shape; no whole call is wider than its shape's check{oracle}")


def _counts(rows: tuple[int, ...]) -> str:
    """(1, 2, 3, 4, 5, 6, 7, 8, 17, 64, 129) -> "1-8, 17, 64 and 129", for the start log."""
    run = next((i for i, count in enumerate(rows) if count != i + 1), len(rows))
    parts = ([f"1-{rows[run - 1]}"] if run > 1 else [str(count) for count in rows[:run]]) + [str(c) for c in rows[run:]]
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"
