"""Tiny random models of the popular open model families, each built offline from its transformers config: two
layers, hidden size 64, four query heads over two KV heads of 16 dimensions, whatever else the family does kept
(QK norms, soft-capping, sliding windows, sinks, MoE routing, MLA's latent KV, partial rotary).

A sliding window is 8 tokens, shorter than every prompt the tests send, so a window that is ignored or misplaced
changes the tokens. `build(family, vocab_size)` returns the model in fp32, eval mode, its output layer sharpened so
greedy ties cannot make comparisons flaky (as tests/conftest.py's tiny model)."""

from __future__ import annotations

import torch

WINDOW = 8
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
ALTERNATING = ["sliding_attention", "full_attention"]


def _configs() -> dict:
    import transformers as tf

    return {
        "llama": lambda: tf.LlamaConfig(**COMMON),
        "mistral": lambda: tf.MistralConfig(sliding_window=None, **COMMON),  # Mistral 7B v0.3, Mistral Small 3
        "qwen2": lambda: tf.Qwen2Config(**COMMON),
        "qwen3": lambda: tf.Qwen3Config(**COMMON),  # q and k norms per head
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                               decoder_sparse_step=1, **COMMON),
        "gemma2": lambda: tf.Gemma2Config(sliding_window=WINDOW, layer_types=ALTERNATING, final_logit_softcapping=3.0,
                                          attn_logit_softcapping=5.0, **COMMON),
        "gemma3_text": lambda: tf.Gemma3TextConfig(sliding_window=WINDOW, layer_types=ALTERNATING, **COMMON),
        "phi3": lambda: tf.Phi3Config(partial_rotary_factor=0.5, pad_token_id=0, **COMMON),  # Phi-4-mini's rotary
        "granite": lambda: tf.GraniteConfig(logits_scaling=4.0, residual_multiplier=0.5, embedding_multiplier=2.0,
                                            attention_multiplier=0.2, **COMMON),
        "olmo2": lambda: tf.Olmo2Config(pad_token_id=0, **COMMON),  # q and k norms over all heads
        "cohere2": lambda: tf.Cohere2Config(sliding_window=WINDOW, layer_types=ALTERNATING, logit_scale=0.25,
                                            **COMMON),
        "mixtral": lambda: tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                                            **COMMON),
        "deepseek_v3": lambda: tf.DeepseekV3Config(  # MLA: latent KV of 32 + a shared rotary key of 16
            **(COMMON | dict(num_key_value_heads=4, head_dim=16)), q_lora_rank=32, kv_lora_rank=32,
            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1, n_shared_experts=1),
        "gpt_oss": lambda: tf.GptOssConfig(sliding_window=WINDOW, layer_types=ALTERNATING, num_local_experts=4,
                                           num_experts_per_tok=2, **COMMON),  # attention sinks, MoE
    }


FAMILIES = (
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "granite", "olmo2", "cohere2",
    "mixtral", "deepseek_v3", "gpt_oss")


def config(family: str, vocab_size: int):
    config = _configs()[family]()
    config.vocab_size = vocab_size
    return config


def build(family: str, vocab_size: int, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(family, vocab_size), dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    return model


def _refused_configs() -> dict:
    import transformers as tf

    attention = COMMON
    return {
        "falcon_h1": lambda: tf.FalconH1Config(**attention, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                                               mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16),
        "qwen3_next": lambda: tf.Qwen3NextConfig(**attention, layer_types=["linear_attention", "full_attention"],
                                                 linear_num_value_heads=2, linear_num_key_heads=2,
                                                 linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
                                                 num_experts_per_tok=2, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=32),
        "mamba": lambda: tf.MambaConfig(hidden_size=64, num_hidden_layers=2, state_size=8),
        "llama4_text": lambda: tf.Llama4TextConfig(**attention, attention_chunk_size=WINDOW, num_local_experts=2,
                                                   intermediate_size_mlp=128),
    }


REFUSED = ("falcon_h1", "qwen3_next", "mamba", "llama4_text")  # hybrids, pure Mamba, chunked attention


def refused_config(family: str, vocab_size: int):
    config = _refused_configs()[family]()
    config.vocab_size = vocab_size
    return config
