"""Adaptable linears: each row of a pass adds its own adapter's low-rank product, or nothing.

A pass flattens many requests' tokens into one row (app/core/runner/packed.py), each request a span of it. Before
the pass, `forward` says which spans use which adapter (`adapter_rows`); every wrapped linear then computes

    out = base(x)                                       the layer as loaded: nn.Linear, a batched-rows or int8 one
    out[rows of a] += scale_a * (x[rows of a] @ A_a.T) @ B_a.T      for each adapter a in the pass

in plain PyTorch, by adapter (punica's idea without its kernels): two thin matmuls per adapter and layer, no merged
copy of any weight. The engine puts each adapter's rows side by side in the pass (app/core/engine/step.py), so an
adapter's rows are one slice, read and written in place; rows spread apart are gathered and scattered instead. Rows without an adapter get nothing added, so they are exactly the base model's.
The order of the product is peft's own unmerged forward's; a merged model rounds differently, within ~1e-6 in fp32.

Outside `adapter_rows` (the oracle loop, warm-up, a compiled step's trace) a wrapped layer is its base layer.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator, Sequence

import torch
from torch import nn

# this pass's adapters: (the adapter, its token rows in the flattened pass: one slice, or an index tensor)
_ROWS: ContextVar[list[tuple[Any, slice | torch.Tensor]] | None] = ContextVar("adapter_rows", default=None)


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
        for adapter, rows_of in rows:
            pair = adapter.weights.get(self.name)
            if pair is None:  # this adapter leaves this layer alone
                continue
            a, b = pair  # [r, in], [out, r]
            if isinstance(rows_of, slice):  # one run of rows (the engine puts an adapter's rows side by side)
                flat_out[rows_of].addmm_(flat_x[rows_of] @ a.T, b.T, alpha=adapter.scale)  # a view: in place
            else:
                flat_out.index_add_(0, rows_of, (flat_x[rows_of] @ a.T) @ b.T, alpha=adapter.scale)
        return flat_out.view(out.shape)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


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
def adapter_rows(adapters: Sequence[Any], spans: Sequence[tuple[int, int]], device: torch.device) -> Iterator[None]:
    """Within: the wrapped linears add each span's adapter (None: the base model, nothing added). `spans`: each
    request's [start, end) in the flattened pass, in the order of `adapters`."""
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
    token = _ROWS.set(rows)
    try:
        yield
    finally:
        _ROWS.reset(token)
