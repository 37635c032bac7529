"""CPU, bf16: reorder every linear weight once, at load, into oneDNN's blocked layout.

Why: on the CPU, torch runs a bf16 `F.linear` through oneDNN, which first reorders the [out, in] weight into its
blocked layout, on every call. A decode step is one matrix-vector product per weight, so that reorder costs
as much as the product itself: measured here on Qwen2.5-0.5B, the 24 layers' linears took 36 ms per step
plainly and 13 ms prepacked. Reordering once is what PyTorch's inductor (freezing), IPEX and vLLM's CPU backend
do; we do it with the same private op inductor uses.

The kernel is oneDNN's in both cases, so outputs are bit-identical to `nn.Linear`, which keeps our tokens equal
to transformers' own. `prepack_linears` checks that on every layer as it packs it, and leaves a layer plain
wherever it is not (another CPU, another torch build).

Where it runs: the reorder needs AVX512BW+VL+DQ or AVX-NE-CONVERT (app/models/cpu.py decides from the CPU's
features); should it raise anyway, the model stays plain. A weight tied to the input embedding (SmolLM2's lm_head)
stays plain too: the embedding needs it in the plain layout, so a packed copy would hold it twice.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from app.models.cpu import prepack_support

log = logging.getLogger("app.models.prepack")


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return prepack_support(device, dtype) is None


class PackedLinear(nn.Module):
    """A drop-in `nn.Linear` (bf16, CPU) whose weight lives only in oneDNN's layout."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The batch-size hint picks the blocking; 1 (decode) measured fastest here at every size up to 512 rows.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = linear.bias
        self.weight_bytes = linear.weight.numel() * linear.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features] -> [..., out_features]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _same_as_plain(linear: nn.Linear, packed: PackedLinear) -> bool:
    # One row (decode) and several rows in a batch (prefill, packed steps), on varied values.
    probe = torch.linspace(-2, 2, 5 * linear.in_features, dtype=linear.weight.dtype).reshape(1, 5, -1)
    return all(torch.equal(linear(x), packed(x)) for x in (probe[:, :1], probe))


class PrepackFailed(RuntimeError):
    """oneDNN refused to reorder a weight on this machine."""


@torch.no_grad()
def prepack_linears(model: nn.Module, strict: bool = False) -> int:
    """Swap each `nn.Linear` of `model` for a `PackedLinear`, in place; returns how many were packed.

    If oneDNN refuses a reorder, the layers not yet packed stay plain (one log line), or with `strict` it raises
    `PrepackFailed`. Either way each layer is `nn.Linear` or an exact `PackedLinear`, so the model still runs.
    """
    embedded = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    packed_count = kept = tied = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:  # subclasses (quantized layers and the like) keep their own forward
                continue
            if child.weight.data_ptr() in embedded:
                tied += 1
                continue
            try:
                packed = PackedLinear(child)
            except RuntimeError as err:  # the CPU checks in app/models/cpu.py should make this unreachable
                if strict:
                    raise PrepackFailed(f"oneDNN could not reorder a bf16 weight here: {err}") from err
                log.warning("prepack: oneDNN could not reorder a bf16 weight (%s); %d layers stay plain", err,
                            sum(type(m) is nn.Linear for m in model.modules()))
                return packed_count
            if _same_as_plain(child, packed):
                setattr(parent, name, packed)
                packed_count += 1
            else:
                kept += 1
    if kept:
        log.warning("prepack: %d linear layers gave different results packed and stayed plain", kept)
    if tied:
        log.info("prepack: %d linear layer(s) share their weight with the input embedding and stay plain", tied)
    log.info("prepack: %d linear layers reordered for oneDNN", packed_count)
    return packed_count


def decode_bytes_per_step(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every weight once, except the input embedding table (one row)."""
    sizes: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        for p in module.parameters(recurse=False):
            sizes[id(p)] = p.numel() * p.element_size()  # by id: a tied lm_head counts once, as the Linear it is
        if hasattr(module, "weight_bytes"):  # prepacked or int8 (app/models/quant.py): not plain parameters
            sizes[id(module)] = module.weight_bytes
    return sum(sizes.values())
