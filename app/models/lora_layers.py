"""Adaptable linears: each row of a pass adds its own adapter's low-rank product, or nothing.

A pass flattens many requests' tokens into one row (app/core/runner/packed.py), each request a span of it. Before
the pass, `forward` says which spans use which adapter (`adapter_rows`); every wrapped linear then computes

    out = base(x)                                       the layer as loaded: nn.Linear, a batched-rows or int8 one
    out[rows of a] += scale_a * (x[rows of a] @ A_a.T) @ B_a.T      for each adapter a in the pass

in plain PyTorch, by adapter (punica's idea without its kernels): two thin matmuls per adapter and layer, no merged
copy of any weight. The engine puts each adapter's rows side by side in the pass (app/core/engine/step.py), so an
adapter's rows are one slice, read and written in place; rows spread apart are gathered and scattered instead. Rows without an adapter get nothing added, so they are exactly the base model's.
The order of the product is peft's own unmerged forward's; a merged model rounds differently, within ~1e-6 in fp32.

BATCH_INVARIANT (`adapter_rows(..., invariant=True)`): those two matmuls are called on all of an adapter's rows in
the pass, so a row's product would depend on how many rows the adapter has there (in fp32 on a Zen 4 EPYC, MKL
summed `x @ A.T` otherwise from 2 rows on, at every adapter shape tried, 64 x 4 to 4864 x 16). Under it each
product is called as a base linear of its shape would be: the load-time check of app/models/row_check.py, run on
the first pass that meets an adapter weight of that shape and dtype (28 ms for the default model's five at rank 16,
2 threads of that EPYC), picks whole calls no wider than it tried, fixed tiles, or one call per row; then the
product is scaled and added, `out + (x @ A.T @ B.T) * scale`, as peft writes it, each step elementwise, so a row's
sum is its own whatever shares the pass.

Outside `adapter_rows` (the oracle loop, warm-up, a compiled step's trace) a wrapped layer is its base layer.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from app.models.invariance import tiles_only
from app.models.row_check import SPLIT_NAMES, SPLITS, choose_split, rows_to_check, split_rows

log = logging.getLogger("app.models.lora_layers")

# this pass's adapters: (the adapter, its token rows in the flattened pass: one slice, or an index tensor)
_ROWS: ContextVar[list[tuple[Any, slice | torch.Tensor]] | None] = ContextVar("adapter_rows", default=None)
_INVARIANT: ContextVar[bool] = ContextVar("adapter_rows_invariant", default=False)  # BATCH_INVARIANT this pass
# BATCH_INVARIANT: (split, widest whole call) per adapter weight's (out, in, dtype, device), checked at first use
_PLANS: dict[tuple[int, int, torch.dtype, torch.device], tuple[str, int]] = {}


class LoraLinear(nn.Module):
    """A linear of the model's body (whatever module loaded it) plus each pass's adapters' products."""

    def __init__(self, base: nn.Module, name: str):
        super().__init__()
        self.base_layer, self.name = base, name
        self.in_features, self.out_features = base.in_features, base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        out = self.base_layer(x)
        if torch.compiler.is_compiling():  # a compiled step never carries adapter rows (nor traces a ContextVar)
            return out
        rows = _ROWS.get()
        if rows is None:
            return out
        flat_x, flat_out = x.reshape(-1, self.in_features), out.reshape(-1, self.out_features)
        invariant = _INVARIANT.get()
        for adapter, rows_of in rows:
            pair = adapter.weights.get(self.name)
            if pair is None:  # this adapter leaves this layer alone
                continue
            a, b = pair  # [r, in], [out, r]
            if invariant:  # each product in checked calls, then scaled and added elementwise
                delta = invariant_product(invariant_product(flat_x[rows_of], a), b) * adapter.scale
                if isinstance(rows_of, slice):
                    flat_out[rows_of].add_(delta)
                else:
                    flat_out.index_add_(0, rows_of, delta)
            elif isinstance(rows_of, slice):  # one run of rows (the engine puts an adapter's rows side by side)
                flat_out[rows_of].addmm_(flat_x[rows_of] @ a.T, b.T, alpha=adapter.scale)  # a view: in place
            else:
                flat_out.index_add_(0, rows_of, (flat_x[rows_of] @ a.T) @ b.T, alpha=adapter.scale)
        return flat_out.view(out.shape)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def invariant_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ weight.T, weight [out, in] (an adapter's A or B): each row computed the same way at any row
    count, the calls split as the check of this shape chose (app/models/row_check.py), as for a base linear."""
    out_features, in_features = weight.shape
    key = (out_features, in_features, weight.dtype, weight.device)
    if key not in _PLANS:
        splits = SPLITS[1:] if tiles_only(weight.dtype, weight.device) else SPLITS  # as invariance.py's linears
        split, failed = choose_split(lambda rows: F.linear(rows, weight), in_features, out_features, weight.dtype,
                                     splits=splits, device=weight.device)
        _PLANS[key] = split, max(rows_to_check(in_features, out_features))
        log.info("batch invariance: LoRA products of %d x %d (%s) run %s%s", out_features, in_features,
                 str(weight.dtype).removeprefix("torch."), SPLIT_NAMES[split],
                 f" (whole calls computed a row differently from {failed} rows)" if failed is not None else "")
    split, widest = _PLANS[key]
    return split_rows(lambda rows: F.linear(rows, weight), x, split, widest)


def wrap_linears(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Wrap every linear of the model's body (not the output head, which peft's LoRA targets only as an
    embedding-like layer), in place; idempotent. Returns what an adapter may target: name -> (in, out)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets, swaps = {}, []
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            targets[name] = (module.in_features, module.out_features)
        elif (module is not head and hasattr(module, "in_features") and hasattr(module, "out_features")
              and not any(name.startswith(f"{done}.") for done in targets)):
            targets[name] = (module.in_features, module.out_features)
            swaps.append(name)
    for name in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoraLinear(getattr(parent, child), name))
    return targets


def _runs(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent spans joined: [(0, 3), (3, 4), (6, 7)] -> [(0, 4), (6, 7)]."""
    runs: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end)
        else:
            runs.append((start, end))
    return runs


@contextmanager
def adapter_rows(adapters: Sequence[Any], spans: Sequence[tuple[int, int]], device: torch.device,
                 invariant: bool = False) -> Iterator[None]:
    """Within: the wrapped linears add each span's adapter (None: the base model, nothing added). `spans`: each
    request's [start, end) in the flattened pass, in the order of `adapters`. `invariant`: BATCH_INVARIANT's
    products (`invariant_product`)."""
    groups: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
    for adapter, span in zip(adapters, spans):
        if adapter is not None:
            groups.setdefault(id(adapter), (adapter, []))[1].append(span)
    if not groups:
        yield
        return
    rows = []
    for adapter, owned in groups.values():
        runs = _runs(owned)
        if len(runs) == 1:  # a slice of the pass: no gather, no scatter
            rows.append((adapter, slice(*runs[0])))
        else:
            rows.append((adapter, torch.cat([torch.arange(start, end) for start, end in runs]).to(device)))
    token, invariant_token = _ROWS.set(rows), _INVARIANT.set(invariant)
    try:
        yield
    finally:
        _INVARIANT.reset(invariant_token)
        _ROWS.reset(token)
