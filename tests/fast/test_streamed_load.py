"""The streamed load (app/models/streamed_load.py): the same model as from_pretrained + quantize_linears, tensor for
tensor, in the memory it runs in."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from app.models import streamed_load
from app.models.loading import load_model
from app.models.quant import DynamicInt8Linear, quantize_linears
from app.models.streamed_load import NotStreamable, stream_model
from conftest import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
PROMPT = torch.tensor([[1, 5, 9, 14, 3]])


def save_tiny(path: Path, tokenizer, tied: bool = False) -> Path:
    model = build_tiny_model(len(tokenizer))
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def held(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the model computes with: parameters, buffers (persistent or not), and the int8 weights and scales
    inside fbgemm's packed ones."""
    out = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, module in model.named_modules():
        if isinstance(module, DynamicInt8Linear):
            weight, _ = torch.ops.quantized.linear_unpack(module.packed)
            out[f"{name}.int8"] = weight.int_repr()
            out[f"{name}.scales"] = weight.q_per_channel_scales()
    return out


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_a_streamed_model_holds_exactly_what_from_pretrained_and_quantize_linears_hold(tmp_path, tiny_tokenizer,
                                                                                       quant, tied):
    path = save_tiny(tmp_path, tiny_tokenizer, tied)
    old = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu").eval()
    if quant != "none":
        quantize_linears(old, quant, dtype=torch.float32)
    new = stream_model(path, AutoConfig.from_pretrained(path), torch.float32, quant, torch.float32).eval()
    assert repr(new) == repr(old)  # the same modules: each linear quantized the same way
    old_held, new_held = held(old), held(new)
    assert new_held.keys() == old_held.keys()
    assert [n for n in old_held if not torch.equal(new_held[n], old_held[n])] == []  # bit for bit, rotary included
    assert all(t.device.type == "cpu" for t in new_held.values())
    if tied and quant == "none":
        assert new.lm_head.weight is new.model.embed_tokens.weight
    expected = old.generate(PROMPT, max_new_tokens=16, do_sample=False)
    assert torch.equal(new.generate(PROMPT, max_new_tokens=16, do_sample=False), expected)


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_load_model_streams_and_answers_as_the_from_pretrained_path_does(tiny_dir, monkeypatch, caplog, quant):
    with caplog.at_level(logging.INFO, logger="app.models.streamed_load"):
        streamed = load_model(str(tiny_dir), "cpu", "auto", quant=quant)
    assert "weights streamed from the safetensors files" in caplog.text

    def no_files(directory):
        raise NotStreamable("this test's")

    monkeypatch.setattr(streamed_load, "_shards", no_files)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="app.models.streamed_load"):
        loaded = load_model(str(tiny_dir), "cpu", "auto", quant=quant)
    assert "weights loaded by from_pretrained, not streamed: this test's" in caplog.text
    assert (streamed.dtype, streamed.prepack, streamed.weight_bytes) == (loaded.dtype, loaded.prepack,
                                                                         loaded.weight_bytes)
    expected = loaded.model.generate(PROMPT, max_new_tokens=16, do_sample=False)
    assert torch.equal(streamed.model.generate(PROMPT, max_new_tokens=16, do_sample=False), expected)


def test_names_the_model_does_not_have_load_through_from_pretrained_and_the_log_says_why(tmp_path, tiny_tokenizer,
                                                                                          caplog):
    path = save_tiny(tmp_path, tiny_tokenizer)
    weights = load_file(path / "model.safetensors")
    weights["model.norm.gamma"] = weights.pop("model.norm.weight")  # a legacy name transformers renames
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NotStreamable, match="1 names in the files are not the model's \\(model.norm.gamma"):
        stream_model(path, AutoConfig.from_pretrained(path), torch.float32)
    with caplog.at_level(logging.INFO, logger="app.models.streamed_load"):
        lm = load_model(str(path), "cpu", "float32", quant="int8")
    assert "not streamed: 1 names in the files are not the model's" in caplog.text
    assert torch.equal(lm.model.model.norm.weight, weights["model.norm.gamma"])


def test_a_sharded_checkpoint_streams_shard_by_shard(tmp_path, tiny_tokenizer):
    path = save_tiny(tmp_path / "whole", tiny_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert len(json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    shards = streamed_load._shards(tmp_path / "sharded")
    assert len(shards) > 1
    new = stream_model(tmp_path / "sharded", model.config, torch.float32, "int8", torch.float32)
    quantize_linears(model, "int8", dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(held(new).values(), held(model).values(), strict=True))


PEAK_SCRIPT = textwrap.dedent("""
    import sys, torch
    from app.models.loading import load_model

    def status(key):
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))

    lm = load_model(sys.argv[1], "cpu", "auto", quant=sys.argv[2])
    lm.model.generate(torch.tensor([[1, 5, 9, 14, 3]]), max_new_tokens=8, do_sample=False)
    print(status("VmHWM"), status("VmRSS"))
""")


@pytest.mark.full
@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_loading_peaks_within_1_3x_of_the_memory_the_model_runs_in(tmp_path_factory, tiny_tokenizer, quant):
    """Issue 59: the load's peak (VmHWM) at most 1.3x the resident memory after one answer, on a random model of a
    real shape scaled down (a bf16 checkpoint of ~300 MB), in a process of its own."""
    from transformers import Qwen2Config

    path = tmp_path_factory.getbasetemp() / "streamed-peak-model"
    if not (path / "model.safetensors").is_file():
        config = Qwen2Config(vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512,
                             tie_word_embeddings=False)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
        tiny_tokenizer.save_pretrained(path)
    run = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path), quant], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    peak, resident = map(int, run.stdout.split()[-2:])
    assert peak <= 1.3 * resident, f"QUANT={quant}: peak {peak / 1024:.0f} MiB, resident {resident / 1024:.0f} MiB"
