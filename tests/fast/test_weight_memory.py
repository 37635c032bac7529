"""The weights' memory as an operator sees it (app/models/weight_memory.py): bytes by format in the start log,
/metrics and /v1/models, every copy counted apart, a tied table once."""

from __future__ import annotations

import httpx
import pytest
import torch

from app.config import Settings
from app.main import create_app
from app.metrics import parse_samples
from app.models.loading import load_model
from app.models.weight_memory import FORMATS, weight_bytes_by_format

from conftest import ThreadServer, build_tiny_model


def linear_weights(model) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.full
def test_v1_models_and_metrics_give_the_weight_bytes_by_format(tiny_dir, caplog):
    with caplog.at_level("INFO", logger="app.models.loading"):
        lm = load_model(str(tiny_dir), "cpu", "auto", quant="int8")
    assert "weights in memory: int8 " in caplog.text and "embeddings " in caplog.text and "no copies" in caplog.text
    with ThreadServer(create_app(Settings(model="tiny"), lm=lm)) as server:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]
        metrics = parse_samples(httpx.get(server.url + "/metrics").text)
    held = model["weight_bytes"]
    assert held["total"] == sum(held[name] for name in FORMATS) and held["int8"] > 0 and held["copies"] == 0
    for name in FORMATS:
        assert metrics[f'simple_serve_weight_bytes{{format="{name}"}}'] == held[name]
    assert metrics["simple_serve_kv_cache_budget_bytes"] > 0 and "simple_serve_prefix_cache_bytes" in metrics


def test_fp32_copies_for_batched_rows_are_counted_as_copies(tiny_tokenizer):
    from app.models.batch_rows import use_batch_rows

    model = build_tiny_model(len(tiny_tokenizer))
    plain = weight_bytes_by_format(model)
    assert plain["fp32"] == 4 * linear_weights(model) and plain["copies"] == 0
    use_batch_rows(model, packed=True)
    packed = weight_bytes_by_format(model)
    assert packed["fp32"] == plain["fp32"] and packed["copies"] == plain["fp32"]  # the linears' size again
    assert packed["embeddings"] == 4 * model.get_input_embeddings().weight.numel()


def test_a_tied_table_counts_once(tiny_tokenizer):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    held = weight_bytes_by_format(model)
    table = 4 * model.get_input_embeddings().weight.numel()
    assert held["embeddings"] == table and held["fp32"] == 4 * linear_weights(model) - table  # lm_head: the table
