"""BATCH_INVARIANT's check of one linear kernel: does a row come out the same, bit for bit, whatever other rows
share its call? And the ways to call a kernel that fix it where it does not.

A kernel may sum a row's products in another order when the call has more rows (oneDNN and MKL pick their blocking
by the row count M; fbgemm's dynamic int8 quantizes the whole call's input with one scale). Whether one does is a
property of the kernel, the shape, the CPU and the thread count, so it is checked at load, on this machine, on one
layer of each shape (`first_variant_rows`), rather than assumed. A kernel that fails is called another way
(`split_rows`), from fast to slow:
- "whole": one call for all the rows, as the kernel is, up to the widest call its check tried (`rows_to_check`:
  129 rows, fewer for a large lm_head); a call of more rows, which the engine can always send (prompt-logprob
  chunks, verify rows, many streams), goes in calls of that many and one of the rest, so the kernel never sees a
  row count wider than it was checked at;
- "tiles": calls of exactly TILE_ROWS rows, the last padded with zeros, so the kernel always sees the same M (it
  must still compute a row the same way at each position of its tile: checked too);
- "rows": one call per row, M = 1 always: invariant by construction, but the weight is read once per row.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

# Row counts a check calls with: every count from one row (a lone decode step) to a full decode batch (MAX_ACTIVE's
# default), then a sample past it: an odd count, a prefill chunk (128 on a CPU) and past it.
CHECK_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 17, 64, 129)
# A check runs sum(rows) x out x in multiply-adds: 224 rows of the default model's lm_head (151,936 x 896) alone took
# ~1 s of fp32 here. A shape checks the leading row counts that fit in this budget, and at least 1, 2 and 3: the
# default model's lm_head 1 to 8 rows (120 rows' worth with the 7 alone calls of a tile's positions: 0.34 s on its
# packed fp32 copy, 2 threads of a Zen 4 EPYC, against 0.25 s for 1, 2, 3 and 8 rows), a 7B's (152,064 x 3584) 1 to
# 3; every other shape of the default model all of them. A call wider than a shape's widest goes in calls of that
# many ("whole" in `split_rows`), so every call of a large lm_head has a row count its check tried.
CHECK_MACS = 17 * 10**9
# "tiles": 8 rows, a full decode batch (MAX_ACTIVE's default) in one call. MKL's fp32 sgemm at M = 8 computed each
# position of the tile as the same row alone here (AVX2, shapes 896 x 896 to 896 x 4864).
TILE_ROWS = 8
SPLITS = ("whole", "tiles", "rows")
SPLIT_NAMES = {"whole": "whole calls", "tiles": f"in tiles of {TILE_ROWS} rows (a call of fewer rows computes "
               f"{TILE_ROWS}: one row's time x2.6 on a Zen 2's MKL fp32, x1.5 on a Zen 5's packed bf16)",
               "rows": "one call per row (each row reads the weights again: a 128-row prefill chunk ~100x slower)"}

RowCall = Callable[[torch.Tensor], torch.Tensor]  # [rows, in] -> [rows, out]


def split_rows(call: RowCall, x: torch.Tensor, split: str, widest: int | None = None) -> torch.Tensor:
    """`call` on the rows of x ([rows, in]), split as `split` says: [rows, out]. `widest` ("whole"): the most rows
    one call may take, the widest its check tried; more go in calls of that many, then one of the rest."""
    if split == "whole":
        if widest is None or x.shape[0] <= widest:
            return call(x)
        return torch.cat([call(x[i : i + widest]) for i in range(0, x.shape[0], widest)])
    if split == "rows":
        return torch.cat([call(x[i : i + 1]) for i in range(x.shape[0])])
    rows, pad = x.shape[0], -x.shape[0] % TILE_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    return torch.cat([call(x[i : i + TILE_ROWS]) for i in range(0, rows + pad, TILE_ROWS)])[:rows]


def _calls(rows: tuple[int, ...]) -> list[int]:
    """The row counts of the calls `first_variant_rows` makes for `rows`."""
    widest = max(rows)
    return [widest] + [count for count in rows if count < widest] + [1] * (min(widest, TILE_ROWS) - 1)


def rows_to_check(in_features: int, out_features: int) -> tuple[int, ...]:
    """The leading CHECK_ROWS whose check fits in CHECK_MACS for this shape (at least 1, 2 and 3 rows); the last is
    the widest call "whole" makes of this shape. A call of a few rows costs what reading the weight does, about
    TILE_ROWS rows' worth of multiply-adds here."""
    kept: tuple[int, ...] = ()
    for rows in CHECK_ROWS:
        cost = sum(max(count, TILE_ROWS) for count in _calls(kept + (rows,))) * in_features * out_features
        if len(kept) >= 3 and cost > CHECK_MACS:
            break
        kept += (rows,)
    return kept


@torch.inference_mode()
def first_variant_rows(call: RowCall, in_features: int, dtype: torch.dtype,
                       rows: tuple[int, ...] = CHECK_ROWS, device: torch.device | str = "cpu") -> int | None:
    """The first row count in `rows` at which a call's rows differ from the same rows elsewhere, or None.

    Every row of each call is compared with the same row of the widest call, and each of the widest call's first
    TILE_ROWS rows with that row alone: every position a tile's row may hold (an AMX Xeon's tiles are where this
    matters), each checked against the row alone through the widest call. Checking every row alone would cost a
    call per row: seconds for a large lm_head."""
    probe = torch.randn(max(rows), in_features, generator=torch.Generator().manual_seed(48)).to(device, dtype)
    widest = call(probe)
    for count in sorted(rows):
        if count < len(probe) and not torch.equal(call(probe[:count]), widest[:count]):
            return count
    for position in range(1, min(len(probe), TILE_ROWS)):  # position 0 alone is the 1-row call above
        if not torch.equal(call(probe[position : position + 1]), widest[position : position + 1]):
            return len(probe)
    return None


def choose_split(call: RowCall, in_features: int, out_features: int, dtype: torch.dtype,
                 splits: tuple[str, ...] = SPLITS, device: torch.device | str = "cpu") -> tuple[str, int | None]:
    """The first of `splits` under which `call` passes the check ("rows" needs none: it always holds), and the row
    count at which the whole call failed (None if it did not)."""
    rows, failed = rows_to_check(in_features, out_features), None
    for split in splits:
        if split == "rows":
            return split, failed
        variant = first_variant_rows(lambda x: split_rows(call, x, split), in_features, dtype, rows, device)
        if variant is None:
            return split, failed
        if split == "whole":
            failed = variant
    return "rows", failed


class RowSplitLinear(nn.Module):
    """A linear layer (any module of `in_features` -> `out_features`) called on its rows as `split` says, at every
    call: what BATCH_INVARIANT does with every kernel, in whole calls no wider than its check's widest where it
    passed, in tiles or per row where it failed."""

    def __init__(self, layer: nn.Module, split: str):
        super().__init__()
        self.layer, self.split = layer, split
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.widest = max(rows_to_check(self.in_features, self.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        out = split_rows(self.layer, x.reshape(-1, self.in_features), self.split, self.widest)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"split={self.split}" + (f", widest={self.widest}" if self.split == "whole" else "")
