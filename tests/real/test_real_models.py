"""The decode loop on the real embedded models, in fp32: identical greedy tokens from our loop, the cache-free
oracle and transformers' generate(), on two architectures (qwen2 and llama)."""

from __future__ import annotations

import pytest
import torch

from app.errors import ConfigError
from app.core.generate import generate, reference_generate
from app.models.loading import load_model
from app.core.sampling import SamplingParams, resolve_sampling_params

pytestmark = pytest.mark.real_model
PROMPTS = {
    "english": "Describe Paris in detail: its history, its districts, its food and its museums.",
    "chinese": "请用中文详细介绍一下北京的历史、文化和美食，至少写三段。",
    "code": "Write a Python function that checks whether a number is prime.",
}
NEW_TOKENS = 64
# The cache-free oracle re-reads the whole sequence for every token, so it costs as much as the other two together:
# it runs the first 32 tokens on the code prompt and 16 on the others (all 64 of each are still checked against
# generate()).
ORACLE_TOKENS = {"english": 16, "chinese": 16, "code": 32}


def three_ways(lm, text: str, oracle_tokens: int = NEW_TOKENS) -> tuple[list[int], list[int], list[int]]:
    ids = lm.encode_chat([{"role": "user", "content": text}])
    # The prompts ask for long answers, so all three run the full 64 tokens under their normal stop rules.
    # Plain greedy: the oracle knows no processors, and generate() must not pick up the model's
    # repetition_penalty from generation_config.json (test_qwen_model_defaults_match_hf covers that path).
    params = SamplingParams(max_tokens=NEW_TOKENS, do_sample=False)
    ours = [e.token_id for e in generate(lm.model, lm.tokenizer, ids, params, lm.eos_ids, lm.max_context)]
    oracle = reference_generate(lm.model, ids, oracle_tokens, lm.eos_ids)
    with torch.inference_mode():
        hf = lm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               do_sample=False, repetition_penalty=1.0, max_new_tokens=NEW_TOKENS,
                               eos_token_id=list(lm.eos_ids), pad_token_id=0)[0, len(ids):].tolist()
    return ours, oracle, hf


@pytest.mark.parametrize("kind", PROMPTS)
def test_qwen_greedy_identical_three_ways(qwen_fp32, kind):
    ours, oracle, hf = three_ways(qwen_fp32, PROMPTS[kind], ORACLE_TOKENS[kind])
    assert len(ours) == NEW_TOKENS and len(oracle) == ORACLE_TOKENS[kind]
    assert ours == hf and ours[: len(oracle)] == oracle


@pytest.mark.parametrize("kind", PROMPTS)
def test_smollm_greedy_identical_three_ways(smollm_fp32, kind):
    ours, oracle, hf = three_ways(smollm_fp32, PROMPTS[kind], ORACLE_TOKENS[kind])
    assert len(ours) == NEW_TOKENS and len(oracle) == ORACLE_TOKENS[kind]
    assert ours == hf and ours[: len(oracle)] == oracle


def test_qwen_model_defaults_match_hf(qwen_fp32):
    """Greedy with the model's own repetition_penalty (1.1) from generation_config.json, as generate() does."""
    lm = qwen_fp32
    ids = lm.encode_chat([{"role": "user", "content": PROMPTS["english"]}])
    params = resolve_sampling_params({"temperature": 0, "max_tokens": 24}, lm.generation_defaults)
    assert params.repetition_penalty == 1.1 and params.greedy
    ours = [e.token_id for e in generate(lm.model, lm.tokenizer, ids, params, lm.eos_ids, lm.max_context)]
    with torch.inference_mode():
        hf = lm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               do_sample=False, max_new_tokens=24)[0, len(ids):].tolist()
    assert ours == hf


def test_qwen_tokenizer_matches_the_article(qwen_fp32):
    """Without the Python vocabulary and merges transformers kept beside the Rust tokenizer (64 MiB here)."""
    assert not hasattr(qwen_fp32.tokenizer, "_vocab") and not hasattr(qwen_fp32.tokenizer, "_merges")
    assert qwen_fp32.encode_text("Which city is the capital of France?") == [
        23085, 3283, 374, 279, 6722, 315, 9625, 30]


def test_qwen_generation_defaults_and_eos(qwen_fp32):
    assert qwen_fp32.generation_defaults == {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
                                             "repetition_penalty": 1.1}
    assert set(qwen_fp32.eos_ids) == {151645, 151643}


def test_qwen_answers_paris_and_streams_chinese_cleanly(qwen_fp32):
    lm = qwen_fp32
    ids = lm.encode_chat([{"role": "user", "content": "Which city is the capital of France?"}])
    events = list(generate(lm.model, lm.tokenizer, ids, SamplingParams(max_tokens=16, do_sample=False),
                           lm.eos_ids, lm.max_context))
    assert "Paris" in "".join(e.text for e in events)
    ids = lm.encode_chat([{"role": "user", "content": PROMPTS["chinese"]}])
    events = list(generate(lm.model, lm.tokenizer, ids, SamplingParams(max_tokens=24, do_sample=False),
                           lm.eos_ids, lm.max_context))
    assert all("\ufffd" not in e.text for e in events)
    assert "".join(e.text for e in events) == lm.tokenizer.decode([e.token_id for e in events],
                                                                  skip_special_tokens=True)


def test_missing_model_path_is_named():
    with pytest.raises(ConfigError, match="/no/such/model"):
        load_model("/no/such/model")
    with pytest.raises(ConfigError, match="missing.gguf"):
        load_model("./missing.gguf")


def test_cli_reports_bad_input_clearly(capsys):
    # In this process, through the CLI's own main(): a subprocess per case cost each its own imports (20 s of the
    # lane on 2 cores); the walkthrough's test still runs `python -m app generate` as a user types it.
    from app.__main__ import main

    assert main(["generate", "hi", "--model", "/no/such/dir"]) == 2
    assert "/no/such/dir" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", "smollm2-135m-instruct", "--top-p", "1.5"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["generate", "Which city is the capital of France?", "--model", "smollm2-135m-instruct",
                 "--temperature", "0", "--max-tokens", "8", "--show-logits", "3"]) == 0
    assert capsys.readouterr().out.count("step") == 8
