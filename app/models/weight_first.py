"""CPU, fp32: the wide linears (more outputs than inputs: the MLP's gate and up projections, lm_head) of a packed
pass computed as `W @ x.T` rather than `x @ W.T`.

Why: for `x @ W.T` with a few rows, MKL's sgemm copies its right-hand side, the whole weight, into its packed
layout on every call, and that copy costs more than the product. Measured on 2 cores of an AVX2-only EPYC (Zen 3),
weights streamed from memory as in a decode step: Qwen2.5-0.5B's 4864 x 896 up projection took 1.35 ms for one row
but 3.26 / 2.71 / 3.20 ms for 2 / 8 / 16 rows as `x @ W.T`, and 1.09 / 1.70 / 2.40 ms as `W @ x.T`, where the few
rows are what gets packed (12.4 against 10.9 ms at 128 rows); the 151,936 x 896 lm_head took 36 ms for one row and
116-130 ms for 8 as `x @ W.T`, 46-49 ms as `W @ x.T`. Narrow and square linears showed no such gap, and keep
`F.linear`.

Exactness: the order of the sums changes, so several rows round differently, within ~2e-6 of `x @ W.T`, as much
as `x @ W.T` with several rows already differs from each row alone. So it is used only in the engine's passes
(`weight_first_rows()`, under which app/core/generate.py's `forward_many` runs), whose tokens are tested against
solo runs and `model.generate()`; one row, and every call outside those passes (the article's loop in
app/core/generate.py, `model.generate()` itself), is `F.linear`, bit for bit what `nn.Linear` computes.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

_ENGINE_PASS: ContextVar[bool] = ContextVar("engine_pass", default=False)


@contextmanager
def weight_first_rows() -> Iterator[None]:
    """Within: wide fp32 linears compute several rows as `W @ x.T`."""
    token = _ENGINE_PASS.set(True)
    try:
        yield
    finally:
        _ENGINE_PASS.reset(token)


class WeightFirstLinear(nn.Module):
    """A drop-in `nn.Linear` (CPU, fp32) that shares the original's weight: a tied embedding stays one tensor."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 1 or not _ENGINE_PASS.get():
            return F.linear(x, self.weight, self.bias)
        out = torch.mm(self.weight, rows.T).T  # [out, rows] -> [rows, out]
        if self.bias is not None:
            out = out + self.bias
        return out.contiguous().reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def use_weight_first(model: nn.Module) -> int:
    """Swap each plain fp32 CPU `nn.Linear` with more outputs than inputs for `WeightFirstLinear`, in place;
    returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.out_features > child.in_features
                    and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32):
                setattr(parent, name, WeightFirstLinear(child))
                count += 1
    return count
