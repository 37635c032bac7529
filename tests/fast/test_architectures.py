"""Architectures the engine cannot serve exactly are refused at start, before any weight is read, with a message
naming what the model has (app/models/architectures.py): recurrent-state layers (Mamba, linear attention, hybrids)
and chunked attention. The families it serves are tested path by path in test_model_matrix.py."""

from __future__ import annotations

import json

import pytest
import torch

from app.core.generate import generate
from app.core.sampling import SamplingParams
from app.errors import ConfigError
from app.models.loading import load_model
from arch_models import REFUSED, refused_config

REASONS = {
    "falcon_h1": r"falcon_h1 has hybrid layers, which keep a recurrent state rather than a KV cache",
    "qwen3_next": r"qwen3_next has linear_attention layers, which keep a recurrent state rather than a KV cache",
    "mamba": r"mamba has linear_attention layers, which keep a recurrent state rather than a KV cache",
    "llama4_text": r"llama4_text uses chunked attention \(attention_chunk_size=8\)",
}


@pytest.mark.parametrize("family", REFUSED)
def test_an_unservable_architecture_is_refused_at_start_naming_what_it_has(family, tmp_path, tiny_tokenizer):
    """Only config.json and the tokenizer are there: the refusal comes before any weight would be read."""
    config = refused_config(family, len(tiny_tokenizer))
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    tiny_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=REASONS[family]) as err:
        load_model(str(tmp_path), device="cpu", dtype="float32")
    assert err.value.param == "model"


def test_every_served_family_passes_the_check(tiny_tokenizer):
    from arch_models import FAMILIES, config
    from app.models.architectures import unservable

    assert {family: unservable(config(family, len(tiny_tokenizer))) for family in FAMILIES} == dict.fromkeys(FAMILIES)


@pytest.mark.full
def test_why_chunked_attention_is_refused_our_solo_pass_differs_from_generate(tiny_tokenizer):
    """The evidence behind the Llama 4 refusal: one request alone, past two chunks of 8, our loop's greedy tokens
    leave `model.generate()`'s. When this fails, transformers and our pass agree: lift the refusal and add the
    family to the matrix."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(refused_config("llama4_text", len(tiny_tokenizer)),
                                             dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    prompt = tiny_tokenizer.encode("def reverse(s):\n  return s")
    params = SamplingParams(max_tokens=16, do_sample=False, ignore_eos=True)
    ours = [e.token_id for e in generate(model, tiny_tokenizer, prompt, params, (), 256)]
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert ours != theirs[0, len(prompt):].tolist()


def test_the_models_table_knows_every_family_the_matrix_runs_with_an_agreed_parser_name():
    """docs/models.md's rows come from benchmarks/models_table.py's FAMILIES, one per matrix family; its parser names
    are the ones TOOL_CALL_PARSER and REASONING_PARSER take."""
    from arch_models import FAMILIES
    from benchmarks.models_table import FAMILIES as TABLE

    from app.config import Settings
    from app.openai.tools import PARSERS

    assert list(TABLE) == list(FAMILIES)
    assert {f.tools for f in TABLE.values()} - {"none"} <= set(PARSERS)
    for family in TABLE.values():  # each name is one REASONING_PARSER takes (Settings refuses any other)
        Settings(reasoning_parser=family.reasoning)
