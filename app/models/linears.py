"""The walk over a model's linear layers that each load-time swap starts from: prepacking (prepack.py), the fp32
batched-row copies (batch_rows.py) and quantization (quant.py)."""

from __future__ import annotations

from torch import nn


def plain_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, name, linear) for each plain `nn.Linear`, listed whole before the caller swaps any. Subclasses
    (quantized layers and the like) keep their own forward, so they are left out."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear]
