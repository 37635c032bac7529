"""Sibling projections read in one call: a layer's q, k and v (and its MLP's gate and up) multiply the same input, so
where they are quantized for our CPU kernels (`Int4Linear` on ours, `GroupInt8Linear`) their weights are joined into
one layer at load and called once, each projection then taking its rows of that one output.

Why: a decode step at one stream reads every weight once and is bound by memory bandwidth; separate calls cost a
call's fixed work each (the activations quantized again, a parallel region opened, a layer's first bytes fetched
before the prefetcher runs ahead), seven times a layer. Timed on a Zen 4 (2 threads, the 1.5B shapes' 28 layers of
int4 weights from DRAM, one row): 32.0 ms a step in seven calls a layer, 28.5 in four.

The model's own forward is left as it is: `q_proj(x)`, `k_proj(x)`, `v_proj(x)` are still called, in turn, on the same
`x`. The first computes the joined output; the others take their rows of it. A part is served once per joined
call, so any other calling pattern (a part called twice, another input, an input changed in place) computes again
and stays right; under `torch.inference_mode`, whose tensors keep no version counter, an input changed in place
between two parts' calls is not seen (the models' forwards change none). The kernels' layouts are tiles of 16
output rows, so joining is concatenating the packed buffers (each part's rows a multiple of 16, else the layer is
left alone): no repacking, no copy beside.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from app.models.meta_fill import give_back_freed
from app.models.quant_group8 import GroupInt8Linear
from app.models.quant_int4 import Int4Linear

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
TILE_ROWS = 16  # int4_decode.cpp's TILE: output rows per block of the packed layouts


class JoinedProjections(nn.Module):
    """One layer over the rows of several; `part(i, x)` is projection i's output for input `x`."""

    def __init__(self, layer: nn.Module, sizes: list[int]):
        super().__init__()
        self.layer, self.sizes = layer, sizes
        self._input: torch.Tensor | None = None
        self._version = -1
        self._parts: list[torch.Tensor] = []
        self._taken: set[int] = set()

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        version = x._version if not x.is_inference() else -1  # inference tensors keep no version counter
        if self._input is not x or self._version != version or index in self._taken:
            self._parts = list(self.layer(x).split(self.sizes, dim=-1))
            self._input, self._version, self._taken = x, version, set()
        self._taken.add(index)
        out = self._parts[index]
        if len(self._taken) == len(self.sizes):  # every part served: hold no tensor between steps
            self._input, self._parts = None, []
        return out


class ProjectionRows(nn.Module):
    """Stands where one projection stood (`q_proj`, ...), with its in and out features: its rows of a joined call.
    The joined layer is not a child here (it is its own module on the parent), so it is found, counted and wrapped
    (BATCH_INVARIANT, LoRA) once."""

    def __init__(self, joined: JoinedProjections, index: int, in_features: int, out_features: int):
        super().__init__()
        self.index, self.in_features, self.out_features = index, in_features, out_features
        object.__setattr__(self, "joined", joined)  # a plain reference: not registered as a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.joined.part(self.index, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows of a joined call"


def _joined(layers: list[nn.Module]) -> nn.Module | None:
    """The layers as one of their kind, their packed tiles and biases concatenated; None where they cannot be."""
    kind = type(layers[0])
    if kind not in (Int4Linear, GroupInt8Linear) or any(type(layer) is not kind for layer in layers):
        return None
    if kind is Int4Linear and any(layer.kernel is None or layer.wide is not None for layer in layers):
        return None  # aten's layout, or a bf16 copy beside: not tiles of 16 rows
    if len({layer.in_features for layer in layers}) != 1 or any(layer.out_features % TILE_ROWS for layer in layers):
        return None
    if len({layer.bias is None for layer in layers}) != 1:
        return None
    joined = copy.copy(layers[0])  # its kernel and settings; tensors of its own below
    joined._parameters, joined._buffers, joined._modules = {}, {}, {}
    joined.out_features = sum(layer.out_features for layer in layers)
    joined.register_buffer("packed", torch.cat([layer.packed for layer in layers]))
    joined.weight_bytes = joined.packed.numel()
    joined.bias = (None if layers[0].bias is None
                   else nn.Parameter(torch.cat([layer.bias.detach() for layer in layers]), requires_grad=False))
    return joined


@torch.no_grad()
def join_projections(model: nn.Module) -> int:
    """Join each module's q/k/v and gate/up where `_joined` can; returns how many groups were joined."""
    count = 0
    # The parents only: a list of every module would hold each replaced layer, and its packed weights, until the
    # end, and the joined copies of them all beside (a 7B's load peaked 1.8 GB higher so).
    parents = [m for m in model.modules() if any(all(hasattr(m, n) for n in names) for names in SIBLINGS)]
    for module in parents:
        for names in SIBLINGS:
            layers = [getattr(module, name, None) for name in names]
            if any(layer is None for layer in layers) or (joined := _joined(layers)) is None:
                continue
            group = JoinedProjections(joined, [layer.out_features for layer in layers])
            module.add_module("_".join(name.removesuffix("_proj") for name in names) + "_joined", group)
            for index, (name, layer) in enumerate(zip(names, layers)):
                setattr(module, name, ProjectionRows(group, index, layer.in_features, layer.out_features))
            count += 1
            del layers, joined, layer  # the separate layers go now, one group at a time
            give_back_freed()  # and their memory: a load in a thread (the server's) otherwise held ~400 MB more at 3B
    return count


def projection_layers(model: nn.Module) -> list[nn.Module]:
    """Every module of `model`, each projection as the layer that computes its rows: a joined projection as its
    joined layer (once per projection), the joined layers themselves not again. What a count of linears by kind
    means for a model whose projections may be joined."""
    inner = {id(group.layer) for group in model.modules() if isinstance(group, JoinedProjections)}
    return [module.joined.layer if isinstance(module, ProjectionRows) else module
            for module in model.modules() if id(module) not in inner]
