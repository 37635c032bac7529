"""The decode loop on a tiny random model: exactness against the cache-free oracle and HF generate(), streaming
events, stop rules, cache ownership and input validation."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from app.errors import InvalidRequest
from app.core.generate import decode_step, generate, prefill, reference_generate
from app.core.sequence import Sequence, check_request, choose_many
from app.core.sampling import SamplingParams, resolve_sampling_params


def prompt(lm, text="Which city is the capital of France?"):
    return lm.encode_chat([{"role": "user", "content": text}])


def run(lm, ids, **params):
    return list(generate(lm.model, lm.tokenizer, ids, SamplingParams(**params), lm.eos_ids, lm.max_context))


@pytest.mark.full
@pytest.mark.parametrize("text", ["Which city is the capital of France?", "北京是中国的首都", "def reverse(s):"])
def test_greedy_matches_reference_and_hf_generate(tiny_lm, text):
    ids = prompt(tiny_lm, text)
    ours = [e.token_id for e in run(tiny_lm, ids, max_tokens=48, do_sample=False)]
    oracle = reference_generate(tiny_lm.model, ids, 48, tiny_lm.eos_ids)
    hf = tiny_lm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                do_sample=False, max_new_tokens=48, eos_token_id=list(tiny_lm.eos_ids),
                                pad_token_id=0)[0, len(ids):].tolist()
    assert ours == oracle == hf[: len(ours)] and len(ours) == len(hf)


def test_sampling_matches_hf_generate_for_the_same_seed(tiny_lm):
    """Same settings and seed: HF's global-RNG draws equal our per-request generator's draws."""
    ids = prompt(tiny_lm)
    settings = dict(temperature=0.9, top_k=30, top_p=0.9, repetition_penalty=1.2)
    ours = [e.token_id for e in run(tiny_lm, ids, max_tokens=24, seed=1234, ignore_eos=True, **settings)]
    torch.manual_seed(1234)
    hf = tiny_lm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                do_sample=True, max_new_tokens=24, min_new_tokens=24, pad_token_id=0,
                                **settings)[0, len(ids):].tolist()
    assert ours == hf


@pytest.mark.full
def test_seed_reproducible_and_private(tiny_lm):
    ids = prompt(tiny_lm)
    state = torch.get_rng_state()
    a = [e.token_id for e in run(tiny_lm, ids, max_tokens=20, seed=7, temperature=1.5, ignore_eos=True)]
    b = [e.token_id for e in run(tiny_lm, ids, max_tokens=20, seed=7, temperature=1.5, ignore_eos=True)]
    c = [e.token_id for e in run(tiny_lm, ids, max_tokens=20, seed=8, temperature=1.5, ignore_eos=True)]
    assert a == b and a != c
    assert torch.equal(state, torch.get_rng_state()), "a request's sampling must not touch the global RNG"


def test_temperature_zero_is_greedy(tiny_lm):
    ids = prompt(tiny_lm)
    greedy = [e.token_id for e in run(tiny_lm, ids, max_tokens=16, do_sample=False)]
    for seed in (1, 2):
        assert [e.token_id for e in run(tiny_lm, ids, max_tokens=16, temperature=0, seed=seed)] == greedy


def test_max_tokens_and_events(tiny_lm):
    events = run(tiny_lm, prompt(tiny_lm), max_tokens=5, ignore_eos=True)
    assert len(events) == 5
    assert [e.finish_reason for e in events] == [None] * 4 + ["length"]
    text = "".join(e.text for e in events)
    assert text == tiny_lm.tokenizer.decode([e.token_id for e in events], skip_special_tokens=True)


def test_eos_stops_and_min_tokens_bans_it(tiny_lm):
    ids = prompt(tiny_lm)
    eos = tiny_lm.eos_ids[0]
    forced = run(tiny_lm, ids, max_tokens=10, do_sample=False, logit_bias={eos: 100})
    assert [e.token_id for e in forced] == [eos] and forced[-1].finish_reason == "stop"
    held = run(tiny_lm, ids, max_tokens=10, do_sample=False, logit_bias={eos: 100}, min_tokens=4)
    assert len(held) == 5 and held[-1].token_id == eos and held[-1].finish_reason == "stop"
    assert eos not in [e.token_id for e in held[:4]]


def test_stop_string_never_emitted(tiny_lm):
    ids = prompt(tiny_lm)
    free = run(tiny_lm, ids, max_tokens=40, do_sample=False, ignore_eos=True)
    text = "".join(e.text for e in free)
    stop = text[10:13]
    assert stop.strip(), "the tiny model should produce some text"
    events = run(tiny_lm, ids, max_tokens=40, do_sample=False, ignore_eos=True, stop=(stop,))
    streamed = "".join(e.text for e in events)
    assert streamed == text[: text.index(stop)]
    assert events[-1].finish_reason == "stop"


def test_logprobs_and_candidates(tiny_lm):
    ids = prompt(tiny_lm)
    events = run(tiny_lm, ids, max_tokens=3, do_sample=False, logprobs=True, top_logprobs=3)
    for e in events:
        assert e.top_logprobs[0][0] == e.token_id  # greedy picks the most likely token
        assert e.logprob == pytest.approx(e.top_logprobs[0][1]) and e.logprob <= 0


def test_cache_is_per_request_and_feeds_one_token(tiny_lm):
    ids = prompt(tiny_lm)
    params = SamplingParams(max_tokens=4, do_sample=False)
    a = Sequence(tiny_lm.model, tiny_lm.tokenizer, ids, params, tiny_lm.eos_ids, tiny_lm.max_context)
    b = Sequence(tiny_lm.model, tiny_lm.tokenizer, ids[:5], params, tiny_lm.eos_ids, tiny_lm.max_context)
    a.choose(prefill(tiny_lm.model, a))
    b.choose(prefill(tiny_lm.model, b))
    logits = decode_step(tiny_lm.model, a)
    assert logits.shape == (1, tiny_lm.vocab_size) and logits.dtype == torch.float32
    cfg = tiny_lm.model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert a.cache.layers[0].keys.shape == (1, cfg.num_key_value_heads, len(ids) + 1, head_dim)
    assert b.cache.get_seq_length() == 5


def test_bad_input_is_rejected_before_compute(tiny_lm):
    ids = prompt(tiny_lm)
    with pytest.raises(InvalidRequest) as err:
        check_request(ids * 50, SamplingParams(max_tokens=4), tiny_lm.vocab_size, tiny_lm.max_context)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequest) as err:
        check_request(ids, SamplingParams(max_tokens=250), tiny_lm.vocab_size, tiny_lm.max_context)
    assert err.value.code == "context_length_exceeded" and err.value.param == "max_tokens"
    with pytest.raises(InvalidRequest) as err:
        check_request(ids, SamplingParams(logit_bias={10**6: 1.0}), tiny_lm.vocab_size, tiny_lm.max_context)
    assert err.value.param == "logit_bias"
    with pytest.raises(InvalidRequest) as err:
        check_request([], SamplingParams(), tiny_lm.vocab_size, tiny_lm.max_context)
    for field, value in [("max_tokens", 0), ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -1),
                         ("repetition_penalty", 0)]:
        with pytest.raises(InvalidRequest) as err:
            SamplingParams(**{field: value})
        assert err.value.param == field


def test_model_defaults_apply_unless_request_overrides(tiny_lm):
    params = resolve_sampling_params({"top_k": 5}, tiny_lm.generation_defaults)
    assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty) == (0.7, 5, 0.8, 1.1)
    assert params.do_sample
    assert resolve_sampling_params({"temperature": 0}, tiny_lm.generation_defaults).greedy


@pytest.mark.full
def test_choosing_for_a_batch_gives_each_request_what_it_gets_alone(tiny_lm):
    """The engine picks every row's token at once (shared argmax for plain greedy rows, one host transfer);
    each request must still get exactly its own tokens, logprobs and random draws."""
    lm = tiny_lm
    ids = lm.tokenizer.encode("Which city is the capital of France?")
    params = [SamplingParams(max_tokens=12, do_sample=False),
              SamplingParams(max_tokens=12, do_sample=False, repetition_penalty=1.3),
              SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=7),
              SamplingParams(max_tokens=12, temperature=1.0, top_p=0.8, seed=8, logprobs=True, top_logprobs=3),
              SamplingParams(max_tokens=12, do_sample=False, min_tokens=6)]

    def new_seqs():
        return [Sequence(lm.model, lm.tokenizer, ids, p, lm.eos_ids, lm.max_context) for p in params]

    batch, pooled, alone = new_seqs(), new_seqs(), new_seqs()
    logits = torch.cat([prefill(lm.model, s) for s in batch])  # [5, vocab]
    assert batch[0].plain_greedy and not any(s.plain_greedy for s in batch[1:])
    with ThreadPoolExecutor(2) as pool:  # the engine's CPU sampling pool: rows side by side
        for _ in range(12):
            together = choose_many(batch, logits)
            side_by_side = choose_many(pooled, logits, pool)
            one_by_one = [s.choose(logits[row : row + 1]) for row, s in enumerate(alone)]
            assert together == side_by_side == one_by_one
            logits = torch.cat([decode_step(lm.model, s) for s in batch])
    assert [s.n_generated for s in batch] == [12] * 5
