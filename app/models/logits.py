"""Hidden states -> logits, exactly as the model's own `*ForCausalLM.forward` makes them.

Our loop runs the model body (`model.model`) itself, to feed its own caches and positions, so it must also do what
forward does after the body. For most models that is `lm_head` alone, but not for all: Granite divides by
`logits_scaling`, Cohere multiplies by `logit_scale`, Gemma 2 and 3 soft-cap with `final_logit_softcapping`.
Skipping those leaves greedy tokens alone (each is monotonic) but makes sampling and logprobs wrong.

Rather than re-implement each (and miss the next), we call the model's own forward on a shallow copy whose body is
a pass-through: our hidden states go in as `inputs_embeds`, come out as `last_hidden_state`, and every line forward
runs after the body (slicing, `lm_head`, scaling, soft-capping) is transformers' own. The copy shares every weight
and costs one Python call per step.
"""

from __future__ import annotations

import copy
from weakref import WeakKeyDictionary

import torch
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


def head_only(model: nn.Module) -> nn.Module:
    """The model's forward after its body, as a module taking `inputs_embeds=hidden`: for a caller that holds it
    (a compiled step must not trace this module's table of models, whose contents change as models come and go)."""
    return _head_only(model)


def logits_from_hidden(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """hidden: [B, S, hidden_size] from the model body -> logits [B, S, vocab], as `model(...).logits` has them."""
    return _head_only(model)(inputs_embeds=hidden, use_cache=False).logits
