"""Which decoder architectures the engine serves, and why it refuses the others, decided from the config alone
(before any weight is read).

The engine keeps one KV cache per request and feeds it through transformers' attention interface
(app/core/runner/packed.py). That serves every layer that attends over cached keys and values: full attention,
sliding windows (Mistral, Gemma 2/3, Cohere 2, gpt-oss), QK norms, soft-capping, sinks, MoE routing and MLA's
latent KV. It refuses, naming what the model has:
- layers that keep a recurrent state instead of keys and values (Mamba, linear attention, hybrids such as
  Falcon-H1, Qwen3-Next, Jamba, Bamba, Granite 4 hybrids): the engine's caches, prefix cache, speculation's
  roll-back and KV budget all count keys per token, and a state is not that;
- chunked attention (Llama 4's `attention_chunk_size`): served one request per pass, its greedy tokens differed
  from `model.generate()`'s in our tiny Llama 4 (tests/fast/test_architectures.py), so it is not served at all
  rather than served wrong.
"""

from __future__ import annotations

from transformers.cache_utils import get_layer_types_and_kwargs

SERVED_LAYERS = ("full_attention", "sliding_attention")


def unservable(config) -> str | None:
    """Why this model cannot be served (a sentence naming what it has), or None."""
    text = config.get_text_config(decoder=True)
    model_type = getattr(config, "model_type", "this model")
    layer_types, _ = get_layer_types_and_kwargs(text)
    others = sorted({kind for kind in layer_types if kind not in SERVED_LAYERS})
    if "chunked_attention" in others:
        chunk = getattr(text, "attention_chunk_size", "?")
        return (f"{model_type} uses chunked attention (attention_chunk_size={chunk}), which this server does not "
                "serve exactly; only full and sliding-window attention layers are served")
    if others:
        return (f"{model_type} has {', '.join(others)} layers, which keep a recurrent state rather than a KV cache "
                "(Mamba, linear attention or a hybrid of them); this server serves decoders whose every layer is "
                "full or sliding-window attention")
    return None
