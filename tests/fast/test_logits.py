"""Our logits equal the model's own forward, for models that do more than `lm_head`: Granite (`logits_scaling`),
Cohere (`logit_scale`) and Gemma 2 (`final_logit_softcapping`). Greedy tokens would not notice a missing scale;
sampling and logprobs do, so the checks compare logits and logprobs themselves."""

from __future__ import annotations

import pytest
import torch

from app.core.runner.packed import enable_packed_batching
from app.core.generate import decode_step, prefill, reference_generate
from app.core.runner.forward import forward
from app.core.sequence import Sequence
from app.core.sampling import SamplingParams
from app.models.logits import logits_from_hidden

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


def build(arch: str, vocab_size: int):
    from transformers import AutoModelForCausalLM, CohereConfig, Gemma2Config, GraniteConfig, LlamaConfig

    configs = {
        # Each post-processing made large enough that skipping it moves logprobs far beyond float noise.
        "granite": lambda: GraniteConfig(vocab_size=vocab_size, logits_scaling=4.0, **COMMON),
        "cohere": lambda: CohereConfig(vocab_size=vocab_size, logit_scale=0.25, **COMMON),
        "gemma2": lambda: Gemma2Config(vocab_size=vocab_size, final_logit_softcapping=3.0, head_dim=16,
                                       sliding_window=64, **COMMON),
        "llama": lambda: LlamaConfig(vocab_size=vocab_size, **COMMON),  # lm_head alone: must stay exactly that
    }
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(configs[arch](), dtype=torch.float32).eval()
    with torch.no_grad():  # sharpen random logits, so scaling visibly changes the distribution
        model.get_output_embeddings().weight.mul_(8)
    return model


@pytest.fixture(scope="module", params=["granite", "cohere", "gemma2", "llama"])
def arch_model(request, tiny_tokenizer):
    return request.param, build(request.param, len(tiny_tokenizer))


def own_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[:, -1].float()  # [1, vocab]: what the model's forward says


def make_seq(model, tokenizer, ids, **params):
    params = SamplingParams(**{"max_tokens": 8, "do_sample": False, "ignore_eos": True} | params)
    return Sequence(model, tokenizer, ids, params, eos_ids=(), max_context=256)


def test_prefill_and_decode_logits_are_the_models_own(arch_model, tiny_tokenizer):
    arch, model = arch_model
    ids = tiny_tokenizer.encode("The capital of France is Paris. Paris is a city")
    seq = make_seq(model, tiny_tokenizer, ids)
    logits = prefill(model, seq)
    torch.testing.assert_close(logits, own_logits(model, ids), rtol=1e-5, atol=1e-5)
    event = seq.choose(logits)
    torch.testing.assert_close(decode_step(model, seq), own_logits(model, ids + [event.token_id]),
                               rtol=1e-5, atol=1e-5)


def test_logprobs_are_the_models_own(arch_model, tiny_tokenizer):
    """What a user sees: the served logprob of the chosen token is the model's own log-softmax."""
    _, model = arch_model
    ids = tiny_tokenizer.encode("def reverse(s):")
    seq = make_seq(model, tiny_tokenizer, ids, logprobs=True, top_logprobs=3)
    event = seq.choose(prefill(model, seq))
    expected = own_logits(model, ids).log_softmax(-1)[0]
    assert event.logprob == pytest.approx(float(expected[event.token_id]), abs=1e-4)
    top = expected.topk(3)
    assert [t for t, _ in event.top_logprobs] == top.indices.tolist()
    assert [p for _, p in event.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_packed_pass_logits_are_the_models_own(arch_model, tiny_tokenizer):
    arch, model = arch_model
    assert enable_packed_batching(model)  # Gemma 2 too: its soft-capping on its own eager function, per request
    prompts = [tiny_tokenizer.encode(text) for text in ("The capital of France is", "北京是中国的首都")]
    seqs = [make_seq(model, tiny_tokenizer, ids) for ids in prompts]
    logits = forward(model, [(seq, seq.prompt_len) for seq in seqs])
    for row, ids in enumerate(prompts):
        torch.testing.assert_close(logits[row : row + 1], own_logits(model, ids), rtol=1e-5, atol=1e-5)


def test_reference_generate_uses_the_same_logits(arch_model, tiny_tokenizer, monkeypatch):
    _, model = arch_model
    import app.core.generate as generate_module

    calls = []

    def spy(model_, hidden):
        calls.append(hidden.shape)
        return logits_from_hidden(model_, hidden)

    monkeypatch.setattr(generate_module, "logits_from_hidden", spy)
    ids = tiny_tokenizer.encode("Paris is")
    assert len(reference_generate(model, ids, 3, eos_ids=())) == 3
    assert calls == [torch.Size([1, 1, 64])] * 3


def test_logits_follow_a_swapped_lm_head(tiny_tokenizer):
    """Prepacking swaps lm_head after the first call may have built the head-only copy: it must use the new one."""
    model = build("granite", len(tiny_tokenizer))
    hidden = torch.randn(1, 2, 64)
    with torch.inference_mode():
        before = logits_from_hidden(model, hidden)
        model.lm_head = torch.nn.Linear(64, model.config.vocab_size, bias=False)
        torch.testing.assert_close(logits_from_hidden(model, hidden), model.lm_head(hidden) / 4.0)
    assert not torch.equal(before, logits_from_hidden(model, hidden))
