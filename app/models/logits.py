"""Hidden states -> logits, exactly as the model's own `*ForCausalLM.forward` makes them.

Our loop runs the model body (`model.model`) itself, to feed its own caches and positions, so it must also do what
forward does after the body. For most models that is `lm_head` alone, but not for all: Granite divides by
`logits_scaling`, Cohere multiplies by `logit_scale`, Gemma 2 and 3 soft-cap with `final_logit_softcapping`.
Skipping those leaves greedy tokens alone (each is monotonic) but makes sampling and logprobs wrong.

Rather than re-implement each (and miss the next), we call the model's own forward on a shallow copy whose body is
a pass-through: our hidden states go in as `inputs_embeds`, come out as `last_hidden_state`, and every line forward
runs after the body (slicing, `lm_head`, scaling, soft-capping) is transformers' own. The copy shares every weight
and costs one Python call per step.

On a CPU in fp32, a batch's lm_head runs as `BatchedHead` (see there): the vocabulary matrix is the largest in the
model, and the usual `x @ W.T` made MKL copy all of it on every call with more than one row.
"""

from __future__ import annotations

import copy
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from torch import nn


class _BodyOutput:
    """What the pass-through body returns: the hidden states, and None for anything else forward may read."""

    def __init__(self, hidden: torch.Tensor):
        self.last_hidden_state = hidden

    def __getitem__(self, index: int) -> torch.Tensor:  # older forwards read `outputs[0]`
        if index != 0:
            raise IndexError(index)
        return self.last_hidden_state

    def __getattr__(self, name: str) -> None:  # past_key_values, hidden_states, attentions, router_logits ...
        return None


class _PassThroughBody(nn.Module):
    def forward(self, inputs_embeds: torch.Tensor | None = None, **kwargs) -> _BodyOutput:
        return _BodyOutput(inputs_embeds)


_heads: WeakKeyDictionary = WeakKeyDictionary()  # model -> its head-only copy


def _head_only(model: nn.Module) -> nn.Module:
    body = model.base_model_prefix  # "model" for Llama, Qwen2, Granite, Cohere, Gemma ...
    head = _heads.get(model)
    # Rebuild if a child was swapped since (prepacking replaces lm_head): the copy must see today's layers.
    if head is None or any(head._modules.get(name) is not child for name, child in model._modules.items()
                           if name != body):
        head = copy.copy(model)  # shares parameters, buffers and config with the model
        head.__dict__["_modules"] = dict(model._modules)  # its own child table, so the model keeps its body
        setattr(head, body, _PassThroughBody())
        _heads[model] = head
    return head


def logits_from_hidden(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """hidden: [B, S, hidden_size] from the model body -> logits [B, S, vocab], as `model(...).logits` has them."""
    return _head_only(model)(inputs_embeds=hidden, use_cache=False).logits


class BatchedHead(nn.Module):
    """A drop-in lm_head (CPU, fp32) that computes several rows as `W @ x.T` instead of `x @ W.T`.

    For `x @ W.T` with a few rows, MKL's sgemm packs its right-hand side, here the whole [vocab, hidden] matrix
    (545 MB for Qwen2.5-0.5B), on every call: on 2 AVX2 cores 8 rows took 116-130 ms against 36 ms for one row.
    Written as `W @ x.T`, the few rows are what gets packed and the matrix is streamed once: 46-49 ms for 8 rows,
    37 ms for 2, 109 against 183 ms for 32. One row keeps `F.linear`, bit for bit what `nn.Linear` and
    `generate()` compute. Several rows round differently from `x @ W.T`, within ~2e-6; so does `x @ W.T` itself
    against each row alone, which is why batched steps are tested on their tokens against solo runs.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # shared: a tied embedding table stays one tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., hidden] -> [..., vocab]
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 1:
            return F.linear(x, self.weight, self.bias)
        out = torch.mm(self.weight, rows.T).T  # [vocab, rows] -> [rows, vocab]
        if self.bias is not None:
            out = out + self.bias
        return out.contiguous().reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def use_batched_head(model: nn.Module) -> bool:
    """Swap a plain fp32 lm_head on the CPU for `BatchedHead`, in place; False where that does not apply."""
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear or head.weight.device.type != "cpu" or head.weight.dtype != torch.float32:
        return False
    model.lm_head = BatchedHead(head)
    return True
