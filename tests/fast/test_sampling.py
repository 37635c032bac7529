"""Sampling: our logits pipeline against Hugging Face's own processors, seeded draws, parameter validation.

The reference is `transformers.generation.logits_process` itself (not a re-implementation), so "same settings,
same tokens as HF generate()" is checked, not assumed. All CPU, a few seconds.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from app.errors import InvalidRequest
from app.core.sampling import (
    BUILTIN_DEFAULTS,
    SamplingParams,
    apply_logit_bias,
    apply_min_p,
    apply_presence_frequency_penalty,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    make_generator,
    process_logits,
    resolve_sampling_params,
    sample,
    suppress_tokens,
)

# ---------------------------------------------------------------- helpers

KINDS = ("normal", "wide", "peaked", "huge_peak", "ties", "some_neg_inf", "all_negative")


def make_logits(seed: int, kind: str, batch: int | None = None, vocab: int | None = None) -> torch.Tensor:
    """Random float32 logits [B, V], B in 1..4 and V in 50..1000 unless given; `kind` picks the shape of the scores."""
    g = torch.Generator().manual_seed(seed)
    batch = batch or int(torch.randint(1, 5, (1,), generator=g))
    vocab = vocab or int(torch.randint(50, 1001, (1,), generator=g))
    x = torch.randn(batch, vocab, generator=g) * 3
    if kind == "wide":
        x = x * 30
    elif kind == "peaked":  # one token dominates a little
        x[torch.arange(batch), torch.randint(0, vocab, (batch,), generator=g)] += 12.0
    elif kind == "huge_peak":  # one token takes (almost) all the mass, in float32
        x[torch.arange(batch), torch.randint(0, vocab, (batch,), generator=g)] = 1e4
    elif kind == "ties":  # few distinct values: top-k / top-p / min-p boundaries fall on ties
        x = x.round()
    elif kind == "some_neg_inf":  # tokens already removed (e.g. banned), at least half remain
        x = x.masked_fill(torch.rand(batch, vocab, generator=g) < 0.5, -math.inf)
        x[:, 0] = 1.0
    elif kind == "all_negative":
        x = -x.abs() - 1
    return x


def make_history(seed: int, batch: int, vocab: int, length: int | None = None) -> torch.Tensor:
    """Token ids [B, T] with plenty of repeats (a real history repeats tokens)."""
    g = torch.Generator().manual_seed(seed + 10_000)
    length = int(torch.randint(0, 40, (1,), generator=g)) if length is None else length
    pool = torch.randint(0, vocab, (batch, max(1, length // 3 + 1)), generator=g)  # small pool -> repeats
    pick = torch.randint(0, pool.shape[1], (batch, length), generator=g)
    return pool.gather(1, pick)


def assert_same_scores(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), "different tokens were filtered out (-inf)"
    assert torch.equal(torch.isneginf(ours), torch.isneginf(theirs))
    assert not torch.isnan(ours).any()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def call_unmutated(fn, logits: torch.Tensor, *args):
    """Call one of ours and check that it left its input tensors alone."""
    before = [logits.clone()] + [a.clone() for a in args if isinstance(a, torch.Tensor)]
    out = fn(logits, *args)
    after = [logits] + [a for a in args if isinstance(a, torch.Tensor)]
    for b, a in zip(before, after):
        assert torch.equal(b.isnan(), a.isnan()) and torch.equal(b.nan_to_num(), a.nan_to_num()), "input was mutated"
    return out


CASES = [(kind, seed) for kind in KINDS for seed in range(3)]
no_ids = torch.zeros(1, 0, dtype=torch.long)


# ---------------------------------------------------------------- each processor vs HF's


@pytest.mark.parametrize("kind,seed", CASES)
@pytest.mark.parametrize("penalty", [0.3, 0.9, 1.0, 1.1, 1.3, 2.0, 10.0])
def test_repetition_penalty_matches_hf(kind, seed, penalty):
    logits = make_logits(seed, kind)
    history = make_history(seed, *logits.shape)
    ours = call_unmutated(apply_repetition_penalty, logits, history, penalty)
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(history.clone(), logits.clone())
    assert_same_scores(ours, theirs)
    if penalty != 1.0 and history.numel():  # the penalty did something, exactly once per seen token
        assert not torch.equal(ours, logits)


def test_repetition_penalty_applies_once_per_token_and_by_sign():
    logits = torch.tensor([[2.0, -2.0, 4.0, 0.0, 1.0]])
    history = torch.tensor([[0, 0, 0, 1, 3]])  # token 0 three times, still penalised once
    out = apply_repetition_penalty(logits, history, 2.0)
    assert out.tolist() == [[1.0, -4.0, 4.0, 0.0, 1.0]]


@pytest.mark.parametrize("kind,seed", CASES)
@pytest.mark.parametrize("temperature", [0.05, 0.5, 0.7, 1.0, 1.5, 3.0])
def test_temperature_matches_hf(kind, seed, temperature):
    logits = make_logits(seed, kind)
    ours = call_unmutated(apply_temperature, logits, temperature)
    theirs = TemperatureLogitsWarper(temperature)(no_ids, logits.clone())
    assert_same_scores(ours, theirs)


@pytest.mark.parametrize("kind,seed", CASES)
@pytest.mark.parametrize("top_k", [1, 2, 5, 40, 50, 200, -1, 0])  # -1/0 -> V-1/V, in the test body
def test_top_k_matches_hf(kind, seed, top_k):
    logits = make_logits(seed, kind)
    vocab = logits.shape[-1]
    k = {-1: vocab - 1, 0: vocab}.get(top_k, top_k)
    ours = call_unmutated(apply_top_k, logits, k)
    theirs = TopKLogitsWarper(top_k=k)(no_ids, logits.clone())
    assert_same_scores(ours, theirs)
    finite = torch.isfinite(ours).sum(-1)
    assert (finite >= 1).all()  # never removes everything
    if kind not in ("ties", "some_neg_inf"):  # distinct scores: exactly k survive
        assert (finite == min(k, vocab)).all()


def test_top_k_larger_than_vocab_keeps_everything():
    logits = make_logits(0, "normal", batch=2, vocab=60)
    assert torch.equal(apply_top_k(logits, 10_000), logits)
    assert_same_scores(apply_top_k(logits, 10_000), TopKLogitsWarper(top_k=10_000)(no_ids, logits.clone()))


@pytest.mark.parametrize("kind,seed", CASES)
@pytest.mark.parametrize("top_p", [0.01, 0.1, 0.5, 0.8, 0.9, 0.95, 0.999, 1.0])
def test_top_p_matches_hf(kind, seed, top_p):
    logits = make_logits(seed, kind)
    ours = call_unmutated(apply_top_p, logits, top_p)
    # HF's generate() adds TopPLogitsWarper only for top_p < 1.0: at 1.0 the warper itself would still drop tokens
    # whose float32 probability underflows to 0, generate() (and we) keep them.
    theirs = TopPLogitsWarper(top_p=top_p)(no_ids, logits.clone()) if top_p < 1.0 else logits
    assert_same_scores(ours, theirs)
    assert (torch.isfinite(ours).sum(-1) >= 1).all()
    # a best token always survives (with ties at the top, one of them)
    assert torch.equal(ours.amax(-1), logits.amax(-1))


@pytest.mark.parametrize("kind,seed", CASES)
@pytest.mark.parametrize("min_p", [0.0, 0.001, 0.05, 0.1, 0.5, 0.9, 1.0])
def test_min_p_matches_hf(kind, seed, min_p):
    logits = make_logits(seed, kind)
    ours = call_unmutated(apply_min_p, logits, min_p)
    theirs = MinPLogitsWarper(min_p=min_p)(no_ids, logits.clone())
    assert_same_scores(ours, theirs)
    assert torch.equal(ours.amax(-1), logits.amax(-1))  # a best token always survives


# ---------------------------------------------------------------- the whole chain vs HF generate()'s chain


def hf_chain(penalty: float, temperature: float, top_k: int, top_p: float, min_p: float | None,
             do_sample: bool = True) -> LogitsProcessorList:
    """What `GenerationMixin._get_logits_processor` builds for these settings (transformers 5.x, num_beams=1)."""
    procs = LogitsProcessorList()
    if penalty is not None and penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(penalty))
    if do_sample:
        if temperature is not None and temperature != 1.0:
            procs.append(TemperatureLogitsWarper(temperature))
        if top_k is not None and top_k != 0:
            procs.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
        if top_p is not None and top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
        if min_p is not None:
            procs.append(MinPLogitsWarper(min_p=min_p, min_tokens_to_keep=1))
    return procs


chain_settings = dict(
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(KINDS),
    penalty=st.sampled_from([1.0, 0.8, 1.1, 1.3, 2.0]),
    temperature=st.sampled_from([1.0, 0.2, 0.7, 1.3, 2.5]) | st.floats(0.05, 4.0),
    top_k=st.sampled_from([0, 1, 3, 20, 50, 5000]),
    top_p=st.sampled_from([1.0, 0.05, 0.5, 0.9, 0.95]) | st.floats(0.01, 1.0),
    min_p=st.sampled_from([None, 0.0, 0.02, 0.1, 0.5]),
    prompt_len=st.integers(0, 20),
)


@pytest.mark.full
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**chain_settings)
def test_process_logits_matches_hf_chain(seed, kind, penalty, temperature, top_k, top_p, min_p, prompt_len):
    logits = make_logits(seed, kind)
    history = make_history(seed, *logits.shape)
    output_ids = history[:, prompt_len:]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p or 0.0,
                            repetition_penalty=penalty)
    ours = call_unmutated(lambda x: process_logits(x, params, history, output_ids), logits)
    theirs = hf_chain(penalty, temperature, top_k, top_p, min_p)(history.clone(), logits.clone())
    assert_same_scores(ours, theirs)


@pytest.mark.parametrize("kind,seed", CASES)
@pytest.mark.parametrize("penalty", [1.0, 1.2])
def test_greedy_chain_matches_hf_and_picks_argmax(kind, seed, penalty):
    """do_sample=False: HF skips the warpers, so do we; the pick is the argmax of the penalised scores."""
    logits = make_logits(seed, kind)
    history = make_history(seed, *logits.shape)
    params = SamplingParams(do_sample=False, temperature=0.7, top_k=3, top_p=0.5, min_p=0.3,
                            repetition_penalty=penalty)
    ours = process_logits(logits, params, history, history[:, :0])
    theirs = hf_chain(penalty, 0.7, 3, 0.5, 0.3, do_sample=False)(history.clone(), logits.clone())
    assert_same_scores(ours, theirs)
    assert torch.equal(sample(ours, params, None), theirs.argmax(-1))


# ---------------------------------------------------------------- OpenAI penalties, logit_bias, banned tokens


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("presence,frequency", [(0.0, 0.5), (0.7, 0.0), (1.0, 1.0), (-0.5, 0.3), (2.0, -2.0),
                                                (0.0, 0.0)])
def test_presence_frequency_penalty_is_openai_formula(seed, presence, frequency):
    logits = make_logits(seed, "normal")
    output_ids = make_history(seed, *logits.shape)
    ours = call_unmutated(apply_presence_frequency_penalty, logits, output_ids, presence, frequency)
    expected = logits.clone()
    for row in range(logits.shape[0]):
        for token, count in Counter(output_ids[row].tolist()).items():
            expected[row, token] -= count * frequency + presence  # count > 0 here by construction
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-5)


def test_presence_frequency_penalty_counts_output_only_per_row():
    logits = torch.zeros(2, 5)
    output_ids = torch.tensor([[1, 1, 1], [4, 2, 4]])
    out = apply_presence_frequency_penalty(logits, output_ids, presence=0.5, frequency=0.25)
    assert out.tolist() == [[0.0, -1.25, 0.0, 0.0, 0.0], [0.0, 0.0, -0.75, 0.0, -1.0]]


def test_presence_frequency_penalty_in_pipeline_ignores_prompt():
    """Prompt tokens count for repetition_penalty (HF) but not for presence/frequency (OpenAI)."""
    logits = torch.zeros(1, 6)
    seen = torch.tensor([[2, 2, 3, 5]])  # prompt [2, 2, 3] + output [5]
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, do_sample=False)
    out = process_logits(logits, params, seen, seen[:, 3:])
    assert out.tolist() == [[0.0, 0.0, 0.0, 0.0, 0.0, -1.5]]


def test_logit_bias_adds_to_named_ids_only():
    logits = make_logits(3, "normal", batch=3, vocab=100)
    bias = {3: 5.0, 7: -100.0, 99: 0.5}
    out = call_unmutated(apply_logit_bias, logits, bias)
    expected = logits.clone()
    for token, value in bias.items():
        expected[:, token] += value
    torch.testing.assert_close(out, expected)
    assert torch.equal(apply_logit_bias(logits, {}), logits)


def test_logit_bias_steers_greedy_and_sampled_picks():
    logits = make_logits(4, "normal", batch=2, vocab=80)
    forced = SamplingParams(do_sample=False, logit_bias={17: 100.0})
    assert sample(process_logits(logits, forced, no_ids, no_ids), forced, None).tolist() == [17, 17]
    banned_best = int(logits[0].argmax())
    params = SamplingParams(temperature=1.0, logit_bias={banned_best: -100.0}, seed=0)
    gen = make_generator(0, "cpu")
    picks = {int(sample(process_logits(logits[:1], params, no_ids, no_ids), params, gen)) for _ in range(200)}
    assert banned_best not in picks


def test_suppressed_tokens_are_never_sampled():
    logits = torch.zeros(1, 10)
    logits[0, 2] = 10.0  # say EOS is 2 and by far the most likely
    params = SamplingParams(seed=1)
    gen = make_generator(1, "cpu")
    before = logits.clone()
    picks = [int(sample(process_logits(logits, params, no_ids, no_ids, banned_ids=[2]), params, gen))
             for _ in range(300)]
    assert 2 not in picks and len(set(picks)) > 3
    assert torch.equal(logits, before)
    assert torch.isneginf(suppress_tokens(logits, [2, 5])[0, [2, 5]]).all()


# ---------------------------------------------------------------- drawing tokens


def draw(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator, n: int) -> list[list[int]]:
    return [sample(logits, params, gen).tolist() for _ in range(n)]


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = make_logits(0, "normal", batch=2, vocab=200) / 3  # flat enough that draws vary
    params = SamplingParams(temperature=1.0, top_p=0.95)
    processed = process_logits(logits, params, no_ids, no_ids)
    a = draw(processed, params, make_generator(1234, "cpu"), 50)
    b = draw(processed, params, make_generator(1234, "cpu"), 50)
    c = draw(processed, params, make_generator(1235, "cpu"), 50)
    assert a == b
    assert a != c
    assert len({t for step in a for t in step}) > 10  # it really samples


def test_unseeded_generators_differ():
    logits = torch.zeros(1, 1000)
    params = SamplingParams()
    assert draw(logits, params, make_generator(None, "cpu"), 20) != draw(logits, params, make_generator(None, "cpu"), 20)


def test_generator_does_not_touch_global_rng():
    logits = make_logits(5, "normal", batch=3, vocab=300)
    params = SamplingParams(temperature=0.8, top_k=50)
    torch.manual_seed(42)
    state = torch.get_rng_state()
    for seed in (7, None):
        gen = make_generator(seed, "cpu")
        for _ in range(20):
            sample(process_logits(logits, params, no_ids, no_ids), params, gen)
    assert torch.equal(torch.get_rng_state(), state)


def test_global_rng_use_does_not_change_seeded_draws():
    """Another request (or library code) using the global RNG between our draws changes nothing."""
    logits = make_logits(6, "normal", batch=1, vocab=300)
    params = SamplingParams()
    quiet = draw(logits, params, make_generator(99, "cpu"), 30)
    gen, noisy = make_generator(99, "cpu"), []
    for _ in range(30):
        torch.rand(1000)
        torch.multinomial(torch.ones(10), 3)
        noisy.append(sample(logits, params, gen).tolist())
    assert quiet == noisy


@pytest.mark.parametrize("seed", [0, 1, 42, 2**31 - 1, 123456789])
def test_seeded_sample_equals_torch_multinomial_after_manual_seed(seed):
    logits = make_logits(seed % 1000, "normal", batch=3, vocab=500)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=seed)
    processed = process_logits(logits, params, no_ids, no_ids)
    gen = make_generator(seed, "cpu")
    ours = [sample(processed, params, gen) for _ in range(10)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        theirs = [torch.multinomial(processed.softmax(-1), 1).squeeze(1) for _ in range(10)]
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seed", [0, 3, 2024])
def test_seeded_decode_loop_matches_hf_sampling_loop(seed):
    """A fake model's logits each step; HF: its processor list + softmax + torch.multinomial on the global RNG after
    torch.manual_seed(seed) (what generate(do_sample=True) does). Us: process_logits + sample with our generator."""
    batch, vocab, steps = 2, 400, 25
    model_rng = torch.Generator().manual_seed(seed + 1)
    step_logits = [torch.randn(batch, vocab, generator=model_rng) * 2 for _ in range(steps)]
    prompt = torch.randint(0, vocab, (batch, 7), generator=model_rng)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.2, seed=seed)

    gen, ours = make_generator(seed, "cpu"), prompt
    for logits in step_logits:
        nxt = sample(process_logits(logits, params, ours, ours[:, prompt.shape[1]:]), params, gen)
        ours = torch.cat([ours, nxt[:, None]], dim=1)

    chain = hf_chain(1.2, 0.8, 50, 0.9, 0.02)
    theirs = prompt
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for logits in step_logits:
            scores = chain(theirs, logits.clone())
            nxt = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            theirs = torch.cat([theirs, nxt[:, None]], dim=1)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(do_sample=False),
                                    SamplingParams(do_sample=False, temperature=1.5, top_k=5)])
def test_greedy_is_argmax_and_consumes_no_randomness(params):
    assert params.greedy
    logits = make_logits(8, "normal", batch=4, vocab=256)
    gen = make_generator(5, "cpu")
    state = gen.get_state()
    for _ in range(5):
        assert torch.equal(sample(process_logits(logits, params, no_ids, no_ids), params, gen), logits.argmax(-1))
    assert torch.equal(gen.get_state(), state)
    assert torch.equal(sample(logits, params, None), logits.argmax(-1))


def test_temperature_zero_does_not_divide_by_zero():
    logits = make_logits(9, "normal", batch=2, vocab=100)
    out = process_logits(logits, SamplingParams(temperature=0.0, top_p=0.5), no_ids, no_ids)
    assert torch.isfinite(out).all()
    assert torch.equal(out, logits)


def test_sample_shape_is_one_token_per_row():
    logits = make_logits(10, "normal", batch=4, vocab=100)
    for params in (SamplingParams(), SamplingParams(temperature=0)):
        out = sample(logits, params, make_generator(0, "cpu"))
        assert out.shape == (4,) and out.dtype == torch.long
        assert ((out >= 0) & (out < 100)).all()


# ---------------------------------------------------------------- SamplingParams validation

INVALID = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=-0.1), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(min_p=-0.01), "min_p"),
    (dict(min_p=1.01), "min_p"),
    (dict(presence_penalty=2.01), "presence_penalty"),
    (dict(presence_penalty=-2.5), "presence_penalty"),
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=-1), "top_logprobs"),
    (dict(max_tokens=5, min_tokens=6), "min_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(stop=("",)), "stop"),
    (dict(stop=("END", "")), "stop"),
    (dict(logit_bias={1: 101.0}), "logit_bias"),
    (dict(logit_bias={-3: 1.0}), "logit_bias"),
]


@pytest.mark.parametrize("kwargs,param", INVALID, ids=[f"{p}={list(k.values())}" for k, p in INVALID])
def test_invalid_sampling_params_name_the_field(kwargs, param):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert info.value.status == 400
    assert param in str(info.value)


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=1), dict(temperature=0.0), dict(top_p=1.0), dict(top_p=1e-6), dict(top_k=0), dict(min_p=0.0),
    dict(min_p=1.0), dict(presence_penalty=-2.0, frequency_penalty=2.0), dict(top_logprobs=20),
    dict(max_tokens=4, min_tokens=4), dict(min_tokens=10), dict(logit_bias={0: -100.0, 5: 100.0}),
    dict(stop=("\n\n", "###")), dict(repetition_penalty=0.01),
])
def test_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(params, key) == value


def test_check_vocab_rejects_unknown_logit_bias_ids():
    params = SamplingParams(logit_bias={5: 1.0, 1000: 2.0})
    params.check_vocab(1001)  # 1000 exists in a vocabulary of 1001
    with pytest.raises(InvalidRequest) as info:
        params.check_vocab(1000)
    assert info.value.param == "logit_bias"
    assert "1000" in str(info.value)


def test_invalid_request_values_fail_through_resolve_too():
    with pytest.raises(InvalidRequest) as info:
        resolve_sampling_params({"top_p": 1.5}, {"top_p": 0.9})
    assert info.value.param == "top_p"
    with pytest.raises(InvalidRequest) as info:
        resolve_sampling_params({"stop": ""}, {})
    assert info.value.param == "stop"


# ---------------------------------------------------------------- request > generation_config > built-in


MODEL = dict(do_sample=True, temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.05,
             # keys that are in generation_config.json but are not sampling settings must be ignored
             bos_token_id=1, eos_token_id=[2, 3], max_length=32768, transformers_version="4.51.0")


def test_builtin_defaults_when_nothing_is_set():
    params = resolve_sampling_params({}, {})
    for key, value in BUILTIN_DEFAULTS.items():
        assert getattr(params, key) == value
    assert not params.greedy
    assert params.stop == () and params.max_tokens is None


def test_model_defaults_override_builtins():
    params = resolve_sampling_params({}, MODEL)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.6, 0.95, 20, 1.05)
    assert params.min_p == BUILTIN_DEFAULTS["min_p"]
    assert not params.greedy


def test_model_none_values_fall_back_to_builtins():
    params = resolve_sampling_params({}, dict(top_k=None, temperature=None, top_p=0.8))
    assert params.top_k == 0 and params.temperature == 1.0 and params.top_p == 0.8


def test_request_overrides_model_defaults_field_by_field():
    params = resolve_sampling_params(dict(top_p=0.5, max_tokens=7, seed=3, presence_penalty=0.5, temperature=None),
                                     MODEL)
    assert params.top_p == 0.5  # request
    assert params.temperature == 0.6 and params.top_k == 20  # model (None in the request means "not set")
    assert (params.max_tokens, params.seed, params.presence_penalty) == (7, 3, 0.5)


def test_request_temperature_zero_is_greedy_even_if_model_samples():
    params = resolve_sampling_params(dict(temperature=0.0), MODEL)
    assert params.greedy and not params.do_sample


def test_request_temperature_samples_even_if_model_is_greedy():
    model = dict(MODEL, do_sample=False)
    assert resolve_sampling_params({}, model).greedy  # the model's choice, without a request temperature
    assert resolve_sampling_params(dict(top_p=0.5), model).greedy  # top_p alone doesn't switch the mode
    params = resolve_sampling_params(dict(temperature=0.7), model)
    assert params.do_sample and not params.greedy and params.temperature == 0.7


@pytest.mark.parametrize("stop,expected", [("END", ("END",)), (["a", "b"], ("a", "b")), (("\n",), ("\n",)),
                                           ([], ())])
def test_stop_becomes_a_tuple(stop, expected):
    params = resolve_sampling_params(dict(stop=stop), {})
    assert params.stop == expected and isinstance(params.stop, tuple)
    assert params.effective()["stop"] == list(expected)
