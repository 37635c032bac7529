"""CPU, fp32: the several rows of an engine pass (a batched decode step, drafts to verify, a prefill chunk) on
faster kernels than `nn.Linear`'s, while one row stays `nn.Linear`'s own arithmetic, bit for bit.

Why: with a few rows, MKL's sgemm (what `F.linear` runs in fp32) copies the whole weight into its packed layout on
every call, and that copy costs more than the product. Two remedies, measured on 2 cores of an AVX2-only EPYC
(Zen 3), the 24 layers' seven linears plus lm_head of Qwen2.5-0.5B, weights streamed from memory as in a decode
step (interleaved medians, ms per step):

| rows | `F.linear` | wide ones as `W @ x.T` | oneDNN, packed at load |
| --- | --- | --- | --- |
| 1 | 151 | 146 | 114 |
| 2 | 324 | 175 | 127 |
| 8 | 316 | 198 | 155 |
| 16 | 390 | 277 | 194 |
| 32 | 517 | 389 | 329 |
| 128 | 1,235 | 1,046 | 1,007 |
| 512 | 3,682 | 3,190 | 3,492 |

- **Packed** (PREPACK=auto, where the copy fits): each linear keeps a second copy of its weight in oneDNN's blocked
  layout, made once at load (`torch.ops.mkldnn._reorder_linear_weight`, as inductor's freezing does), used for 2 to
  `PACKED_MAX_ROWS` rows. It costs the linears' size again in RAM (1.8 GiB for the default model, lm_head included:
  the embedding keeps the plain table), so `auto` skips it where that would be more than half the RAM available.
- **Otherwise, and past `PACKED_MAX_ROWS`:** the wide linears (more outputs than inputs: the MLP's gate and up,
  lm_head) as `W @ x.T`, where the few rows are what MKL packs; the others `F.linear`.

Why not one row too, where oneDNN is faster still: its sums round differently (~1e-6), and one row is where our
tokens are held bit for bit to the article's loop and `model.generate()`. So every call outside the engine's passes
(`batch_rows()`, under which the engine's passes run: app/core/runner/forward.py), and one row within them, is
`F.linear`.
Several rows round differently from each row alone, within ~2e-6, as any batching does; the tests hold the tokens
of batched fp32 passes equal to solo runs and to `model.generate()`.

**BATCH_INVARIANT** (`use_batch_rows(..., invariant=True)`): within the engine's passes every row count, one
included, goes to one kernel that computes a row the same way whatever the call's other rows, checked at load on
one layer of each shape (app/models/row_check.py), in this order: the packed copy (oneDNN with batch hint 8:
invariant at 1 to 200 rows on the shapes of the default model here; with hint 1 it was not), `F.linear` whole
(MKL: not invariant here, it sums differently from 2 rows on), `F.linear` in tiles of 8 rows (MKL at a fixed M:
invariant here), one `F.linear` per row (invariant by construction). A shape whose packed copy fails keeps no copy.
Without the copy (PREPACK=false, or too little RAM) the tiles are what runs here: measured on 2 busy cores of this
Zen 2, per decode step of the default model's linears, 403 ms at one row against `F.linear`'s 154 (a one-row call
computes a tile of 8), about even at 8 rows. Outside the engine's passes (`generate()`, the fp32 oracle) nothing
changes: `F.linear`, bit for bit `model.generate()`.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from app.models.linears import plain_linears
from app.models.row_check import SPLIT_NAMES, choose_split, rows_to_check, split_rows

log = logging.getLogger("app.models.batch_rows")

# Above this many rows (prefill chunks are 128 on a CPU) the packed copy no longer measured faster; see the table.
PACKED_MAX_ROWS = 64

_ENGINE_PASS: ContextVar[bool] = ContextVar("engine_pass", default=False)


@contextmanager
def batch_rows() -> Iterator[None]:
    """Within: fp32 linears compute several rows on the faster kernels."""
    token = _ENGINE_PASS.set(True)
    try:
        yield
    finally:
        _ENGINE_PASS.reset(token)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


class BatchRowsLinear(nn.Module):
    """A drop-in `nn.Linear` (CPU, fp32) that shares the original's weight (a tied embedding stays one tensor),
    with, if `packed`, a oneDNN-packed copy of it for several rows."""

    def __init__(self, linear: nn.Linear, packed: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.wide = self.out_features > self.in_features
        # The batch-size hint picks oneDNN's blocking: 8 (a full decode batch) measured best at 8 rows here, and
        # within 4% of the best hint (1, 8, 16 or 64) from 2 to 32 rows.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 8) if packed else None
        # BATCH_INVARIANT: (kernel, split) for every row count of an engine pass ("packed" or "plain"; a split of
        # app/models/row_check.py), chosen by `use_batch_rows`; None: the speed rules below. Whole calls take at
        # most `widest` rows, the widest the check tried on this shape.
        self.invariant: tuple[str, str] | None = None
        self.widest = max(rows_to_check(self.in_features, self.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        rows = x.numel() // self.in_features
        # compiled (DECODE_STEP=compiled): plain F.linear, whose kernel inductor chooses itself (it cannot trace
        # the ContextVar anyway)
        if torch.compiler.is_compiling() or not _ENGINE_PASS.get():
            return F.linear(x, self.weight, self.bias)
        if self.invariant is not None:
            kernel, split = self.invariant
            out = split_rows(self.packed_rows if kernel == "packed" else self.plain_rows,
                             x.reshape(rows, self.in_features), split, self.widest)
            return out.reshape(*x.shape[:-1], self.out_features)
        if rows == 1:
            return F.linear(x, self.weight, self.bias)
        if self.packed_weight is not None and rows <= PACKED_MAX_ROWS:
            return packed_linear(x, self.packed_weight, self.bias)
        if not self.wide:
            return F.linear(x, self.weight, self.bias)
        out = torch.mm(self.weight, x.reshape(rows, self.in_features).T).T  # [out, rows] -> [rows, out]
        if self.bias is not None:
            out = out + self.bias
        return out.contiguous().reshape(*x.shape[:-1], self.out_features)

    def packed_rows(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        return packed_linear(x, self.packed_weight, self.bias)

    def plain_rows(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        invariant = f", invariant={'/'.join(self.invariant)}" if self.invariant else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"packed={self.packed_weight is not None}{invariant}")


def _fp32_cpu_linear(module: nn.Module) -> bool:
    return (type(module) is nn.Linear  # subclasses (quantized layers and the like) keep their own forward
            and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32)


def copy_bytes(model: nn.Module) -> int:
    """What packed copies of every fp32 CPU linear would add to memory."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if _fp32_cpu_linear(m))


def copy_bytes_held(model: nn.Module) -> int:
    """What the packed copies swapped in hold (as `copy_bytes` counts them)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if isinstance(m, BatchRowsLinear) and m.packed_weight is not None)


@torch.no_grad()
def use_batch_rows(model: nn.Module, packed: bool, invariant: bool = False) -> int:
    """Swap each plain fp32 CPU `nn.Linear` for a `BatchRowsLinear`, in place: with `packed` or `invariant`, every
    one (with its copy if `packed`); otherwise only the wide ones (the others would gain nothing). Returns how many
    were swapped. A copy that does not give the plain layer's outputs within rounding raises `RuntimeError`, before
    anything is swapped. oneDNN picks its kernel by shape, so one layer of each shape is checked: checking all 169
    of the default model's took 3 of the 12 s of its fp32 load on one thread here. With `invariant`, that layer
    also chooses the shape's kernel for every row count (`invariant_plan`)."""
    swaps, plans = [], {}
    for parent, name, child in plain_linears(model):
        if _fp32_cpu_linear(child) and (packed or invariant or child.out_features > child.in_features):
            shape = (child.out_features, child.in_features, child.bias is not None)
            layer = BatchRowsLinear(child, packed and packed_in(plans.get(shape)))
            if shape not in plans:
                if packed:
                    _check_close(child, layer)
                plans[shape] = invariant_plan(layer) if invariant else None
                if not packed_in(plans[shape]):
                    layer.packed_weight = None  # the shape's packed kernel failed the check: no copy
            layer.invariant = plans[shape]
            swaps.append((parent, name, layer))
    for parent, name, layer in swaps:
        setattr(parent, name, layer)
    return len(swaps)


def packed_in(plan: tuple[str, str] | None) -> bool:
    """Whether a shape's layers keep a packed copy under this plan (None: not invariant, the speed rules)."""
    return plan is None or plan[0] == "packed"


def invariant_plan(layer: BatchRowsLinear) -> tuple[str, str]:
    """(kernel, split) for every row count of `layer`'s engine passes: the packed copy if it has one and it computes
    a row the same way at any row count here, else `F.linear` whole, in tiles, or one row per call
    (app/models/row_check.py)."""
    shape = (layer.in_features, layer.out_features, torch.float32)
    if layer.packed_weight is not None:
        split, failed = choose_split(layer.packed_rows, *shape, splits=("whole",))
        if split == "whole":
            return "packed", "whole"
        log.warning("batch invariance: oneDNN's packed fp32 linear (%d x %d) computes a row differently depending on "
                    "the call's row count (first seen at %d rows); that shape keeps no copy",
                    layer.out_features, layer.in_features, failed)
    split, failed = choose_split(layer.plain_rows, *shape)
    if failed is not None:
        log.info("batch invariance: F.linear fp32 (%d x %d) computes a row differently depending on the call's row "
                 "count (first seen at %d rows); its rows go %s", layer.out_features, layer.in_features, failed,
                 SPLIT_NAMES[split])
    return "plain", split


def _check_close(plain: nn.Linear, layer: BatchRowsLinear) -> None:
    probe = torch.linspace(-2, 2, 5 * plain.in_features).reshape(5, -1)  # several rows, varied values
    with batch_rows():
        got = layer(probe)
    # A sum's rounding grows with the size of its terms, not of its result (which may cancel to near 0): bound the
    # difference by the sum of |x * w|. Reordered sums measured within 3e-6 of it on both real models' linears; a
    # wrong kernel misses by a good part of it.
    scale = probe.abs() @ plain.weight.abs().T + (0 if plain.bias is None else plain.bias.abs())
    if not bool(((got - plain(probe)).abs() <= 1e-4 * scale).all()):
        raise RuntimeError(f"oneDNN's packed fp32 linear ({plain.out_features} x {plain.in_features}) gave "
                           "different results from nn.Linear on this machine")
