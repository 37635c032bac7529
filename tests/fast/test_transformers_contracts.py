"""The transformers internals app/core/runner/packed.py relies on, each checked on its own, so that a transformers release
that changes one fails here by name rather than as wrong tokens somewhere else. pyproject.toml pins transformers
exactly; these say what to check before moving the pin."""

from __future__ import annotations

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, create_causal_mask, sdpa_mask

from conftest import build_tiny_model


def test_a_ready_made_4d_mask_is_used_as_given(tiny_lm):
    """packed_inputs passes a placeholder 4D mask so the model builds none of its own."""
    config = tiny_lm.model.config
    embeds = torch.zeros(1, 5, config.hidden_size)
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    made = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=mask, cache=DynamicCache(),
                              position_ids=torch.arange(5)[None])
    assert made is mask


def test_dynamic_cache_update_appends_and_returns_every_key_so_far(tiny_lm):
    """PackedCaches calls `cache.update(keys, values, layer_idx)` per request and attends to what it returns."""
    cache = DynamicCache(config=tiny_lm.model.config)
    k1, v1 = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    k2, v2 = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    cache.update(k1, v1, 0)
    keys, values = cache.update(k2, v2, 0)
    assert torch.equal(keys, torch.cat([k1, k2], dim=-2)) and torch.equal(values, torch.cat([v1, v2], dim=-2))
    assert cache.get_seq_length(0) == 4


def test_each_layer_hands_its_cache_new_keys_and_attends_to_what_update_returns(tiny_tokenizer):
    """The layer calls `cache.update(key_states, value_states, layer_idx, ...)` with [1, kv_heads, T, head_dim] and
    passes update's return values, untouched, to the registered attention function (PerRequest rides on this)."""
    model = build_tiny_model(len(tiny_tokenizer))
    returned, received = [], []

    class SpyCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            assert isinstance(layer_idx, int) and key_states.shape == value_states.shape == (1, 2, 5, 16)
            out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            returned.append(out)
            return out

    def spy_attention(module, query, key, value, attention_mask, **kwargs):
        received.append((key, value))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("contract_spy", spy_attention)
    AttentionMaskInterface.register("contract_spy", sdpa_mask)
    model.set_attn_implementation("contract_spy")
    with torch.inference_mode():
        model.model(input_ids=torch.tensor([tiny_tokenizer.encode("The capital of France")[:5]]), cache=SpyCache(config=model.config),
                    use_cache=True)
    assert len(returned) == len(received) == model.config.num_hidden_layers
    assert all(k_out is k_in and v_out is v_in for (k_out, v_out), (k_in, v_in) in zip(returned, received))


def test_chat_template_kwargs_cannot_name_an_argument_of_apply_chat_template():
    """app/models/chat_template.py refuses these names in a request's chat_template_kwargs: every parameter of
    apply_chat_template and of the renderer it hands the rest to (a clash was a TypeError 500, or switched
    transformers' own behaviour), and every global of the template environment (a function the template calls)."""
    import inspect

    from transformers import PreTrainedTokenizerBase
    from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template

    from app.models.chat_template import RESERVED_TEMPLATE_ARGS

    params = {name for fn in (PreTrainedTokenizerBase.apply_chat_template, render_jinja_template)
              for name, p in inspect.signature(fn).parameters.items() if p.kind is not p.VAR_KEYWORD}
    environment = set(_compile_jinja_template("{{ x }}").environment.globals)
    assert params | environment <= RESERVED_TEMPLATE_ARGS, (params | environment) - RESERVED_TEMPLATE_ARGS
