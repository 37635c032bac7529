"""BATCH_INVARIANT in the engine (issue 48): with `LoadedModel.batch_invariant` on, a request's answer is the same
alone and amid other requests of other lengths, token for token and logprob for logprob (the floats compared
exactly), with the prefix cache cold and warm, with n-gram speculation on and off, and a seeded sample repeats.

In bf16, with the linears made invariant as loading makes them (app/models/invariance.py: whole calls where bf16 is
not native, as on an AVX2 CPU; fixed tiles where it is, AVX512_BF16 or AMX, whose whole calls vary), so that what
is left to vary is the engine's own doing: attention over a padded width, prefill chunks
cut by what else prefills, prefix-cache KV, verify rows. The prompts run from 3 tokens to 200, across several
16-token pieces and the 128-token prefill budget of a step, so alone and under load their chunks and their decode
rows' padding differ. With BATCH_INVARIANT off the same runs differ, so the comparisons are not vacuous."""

from __future__ import annotations

import asyncio

import pytest
import torch

from app.core.engine.engine import Engine
from app.core.engine.step import align_to_pieces
from app.core.runner.pieces import PIECE, Call, call_keys, invariant_calls
from app.core.sampling import SamplingParams
from app.errors import ConfigError
from app.models.fetch import fetch_model
from app.models.invariance import make_linears_invariant
from app.models.loading import LoadedModel, load_model
from arch_models import build
from conftest import MODEL_CACHE, build_tiny_model

LENGTHS = (3, 20, 45, 130, 200)
N = 24
Answer = list[tuple[int, float]]  # (token id, its logprob) per generated token


def run_rounds(lm, requests: list[tuple[list[int], SamplingParams]], rounds: list[bool],
               **engine_kwargs) -> tuple[list[list[Answer]], list[list[int]], Engine]:
    """One engine, several rounds over the same requests: True submits them all at once (they share steps), False
    one after another. Returns each round's answers, each round's cached prompt tokens, and the engine."""
    engine = Engine(lm, **engine_kwargs)

    async def one(ids, params) -> tuple[Answer, int]:
        handle = engine.submit(ids, params)
        return [(event.token_id, event.logprob) async for event in handle], handle.cached_tokens

    async def main():
        engine.start()
        await asyncio.to_thread(engine.loaded.wait)
        if engine.load_error is not None:
            raise engine.load_error
        try:
            done = []
            for together in rounds:
                if together:
                    done.append(await asyncio.gather(*(one(ids, p) for ids, p in requests)))
                else:
                    done.append([await one(ids, p) for ids, p in requests])
            return done
        finally:
            engine.stop()

    done = asyncio.run(main())
    return [[answer for answer, _ in r] for r in done], [[cached for _, cached in r] for r in done], engine


def bf16_lm(tokenizer, invariant: bool, attention: str = "sdpa") -> LoadedModel:
    model = build_tiny_model(len(tokenizer)).to(torch.bfloat16)
    with torch.no_grad():  # sharper still: a sampled stream repeats itself, so its n-gram drafts get accepted
        model.lm_head.weight.mul_(3)
    model.set_attn_implementation(attention)
    if invariant:  # as load_model does: on an AMX Xeon plain bf16 F.linear gave other answers under load
        make_linears_invariant(model, torch.bfloat16)
    return LoadedModel(model=model, tokenizer=tokenizer, name="tiny-bf16", max_context=256,
                       eos_ids=(tokenizer.convert_tokens_to_ids("<|im_end|>"),), batch_invariant=invariant)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    random = [torch.randint(3, len(tiny_tokenizer), (n,), generator=generator).tolist() for n in LENGTHS]
    repetitive = (tiny_tokenizer.encode("abc def ghi ") * 20)[:60]  # its drafts are accepted
    return random + [repetitive]


def greedy(prompts) -> list[tuple[list[int], SamplingParams]]:
    return [(p, SamplingParams(max_tokens=N, temperature=0.0, logprobs=True, ignore_eos=True)) for p in prompts]


def seeded(prompts) -> list[tuple[list[int], SamplingParams]]:
    return [(p, SamplingParams(max_tokens=N, temperature=0.7, seed=100 + i, logprobs=True, ignore_eos=True))
            for i, p in enumerate(prompts)]


# (which requests, engine settings): loads that each change some request's chunks or its decode rows' company
LOADS = {"all six at once": (slice(None), {}), "the first five at once": (slice(0, 5), {}),
         "all six, 48 prompt tokens a step": (slice(None), {"prefill_tokens_per_step": 48})}


def alone_and_under_loads(lm, prompts) -> list[tuple[list[Answer], list[Answer]]]:
    """(each request's answer alone, under the load) per load in LOADS."""
    (alone,), _, _ = run_rounds(lm, greedy(prompts), [False])
    pairs = []
    for which, settings in LOADS.values():
        (together,), _, _ = run_rounds(lm, greedy(prompts[which]), [True], **settings)
        pairs.append((alone[which], together))
    return pairs


@pytest.mark.parametrize("attention", ["sdpa", pytest.param("eager", marks=pytest.mark.full)])
def test_greedy_answers_alone_and_amid_others_are_bit_identical(tiny_tokenizer, prompts, attention):
    """eager: the packed pass on the model's own eager function (packed_eager_attention), as Gemma 2 runs."""
    (alone, together), _, engine = run_rounds(bf16_lm(tiny_tokenizer, True, attention), greedy(prompts),
                                              [False, True])
    assert engine.batch_decode
    assert together == alone  # every token id and every logprob, exactly


@pytest.mark.full
def test_greedy_answers_are_the_same_under_every_load(tiny_tokenizer, prompts):
    for alone, together in alone_and_under_loads(bf16_lm(tiny_tokenizer, True), prompts):
        assert together == alone


@pytest.mark.full
def test_without_batch_invariance_the_same_loads_change_answers_in_bf16(tiny_tokenizer, prompts):
    """The control: what the comparisons above catch. Measured here: with the first five at once, the 130- and
    200-token prompts' logprobs differ from their 4th and 5th token on (the decode rows' padded attention), and
    with 48 prompt tokens a step, the repetitive prompt's (its chunks)."""
    pairs = alone_and_under_loads(bf16_lm(tiny_tokenizer, False), prompts)
    assert any(together != alone for alone, together in pairs)


@pytest.mark.full
def test_a_warm_prefix_cache_gives_the_cold_answers(tiny_tokenizer, prompts):
    lm = bf16_lm(tiny_tokenizer, True)
    (reference,), _, _ = run_rounds(lm, greedy(prompts), [False])
    (cold, warm), cached, _ = run_rounds(lm, greedy(prompts), [False, True], prefix_cache_bytes=1 << 24)
    assert cached[1] == [(len(p) - 1) // PIECE * PIECE for p in prompts]  # whole blocks, the last token left out
    assert cold == reference and warm == reference


def test_the_prefix_cache_keeps_only_prompt_blocks_under_batch_invariance(tiny_tokenizer, prompts):
    """A generated token's keys come from a decode row, not from a prefill piece, so a later prompt holding it
    would compute it otherwise: only the prompt's own blocks are kept."""
    requests = greedy(prompts[2:3])  # 45 prompt tokens, 24 generated
    _, _, engine = run_rounds(bf16_lm(tiny_tokenizer, True), requests, [False], prefix_cache_bytes=1 << 24)
    assert len(engine.prefix_cache) == 45 // PIECE
    _, _, engine = run_rounds(bf16_lm(tiny_tokenizer, False), requests, [False], prefix_cache_bytes=1 << 24)
    assert len(engine.prefix_cache) == (45 + N - 1) // PIECE  # off: the whole conversation, as before


def test_speculation_gives_the_answers_without_it(tiny_tokenizer, prompts):
    lm = bf16_lm(tiny_tokenizer, True)
    (reference,), _, _ = run_rounds(lm, greedy(prompts), [False])
    (alone, together), _, engine = run_rounds(lm, greedy(prompts), [False, True], speculative="ngram")
    assert engine.metrics.accepted_tokens._value.get() > 0  # drafts were verified and kept
    assert alone == reference and together == reference


@pytest.mark.full
def test_seeded_samples_repeat_alone_under_load_and_with_speculation(tiny_tokenizer, prompts):
    lm = bf16_lm(tiny_tokenizer, True)
    (alone, together), _, _ = run_rounds(lm, seeded(prompts), [False, True])
    (speculated,), _, engine = run_rounds(lm, seeded(prompts), [True], speculative="ngram")
    assert engine.metrics.accepted_tokens._value.get() > 0
    assert together == alone and speculated == alone


def test_prefill_chunks_end_on_pieces_or_at_the_prompt_end():
    # budget shares of 32, 60, 36 for prompts with 0, 16 and 36 tokens done and 100, 60, 36 left
    assert align_to_pieces([32, 60, 36], [0, 16, 36], [100, 60, 36]) == [32, 60, 36]  # on a piece, at the ends
    assert align_to_pieces([40, 20, 30], [0, 16, 32], [100, 60, 36]) == [32, 16, 16]
    assert align_to_pieces([4, 0], [0, 0], [100, 9]) == [16, 0]  # under one piece: the oldest still moves on
    assert align_to_pieces([4], [40], [100]) == [8]  # (a start off a piece: up to the next one)


def test_attention_calls_follow_absolute_positions_not_the_chunk():
    # a prompt's chunk of positions 20..70 amid a decode row at 99 and a verify row of 1 + 2 drafts at 50
    calls = invariant_calls([(0, 50), (50, 51), (51, 54)], [20, 99, 50], [True, False, False])
    assert [(c.span, c.first, c.end, c.as_decode) for c in calls] == [
        (0, 20, 32, False), (0, 32, 48, False), (0, 48, 64, False), (0, 64, 70, False),
        (1, 99, 100, True), (2, 50, 51, True), (2, 51, 52, True), (2, 52, 53, True)]
    assert calls[1].rows == slice(12, 28)
    # keys: from 0 to the call's end; a sliding window of 8 shows a decode row its last 8, a piece 8 - 1 before it
    assert call_keys(calls[1], 70, 70, None) == slice(0, 48)
    assert call_keys(Call(0, slice(0, 1), 99, 100, True), 100, 100, 8) == slice(92, 100)
    assert call_keys(Call(0, slice(0, 16), 32, 48, False), 70, 70 - 13, 8) == slice(25 - 13, 48 - 13)


def test_the_compiled_decode_step_is_refused_under_batch_invariance(tiny_tokenizer):
    with pytest.raises(ConfigError) as caught:
        run_rounds(bf16_lm(tiny_tokenizer, True), [], [], decode_step="compiled")
    assert caught.value.param == "decode_step" and "BATCH_INVARIANT" in str(caught.value)


# SmolLM2-135M in bf16: prompts of ~30 to ~280 tokens (the chat template's own tokens included)
HASH_MAP = ("Explain in detail how a hash map works, what a collision is, and how open addressing and chaining "
            "resolve collisions. ")
REAL_TEXTS = ("Hi!", HASH_MAP * 3, HASH_MAP * 8, "Repeat after me: " + "one two three four five. " * 40)


@pytest.fixture(scope="module")
def smollm_bf16_invariant():
    lm = load_model(str(fetch_model("smollm2-135m-instruct", MODEL_CACHE)), device="cpu", dtype="bfloat16",
                    batch_invariant="on")
    return lm, [lm.encode_chat([{"role": "user", "content": text}]) for text in REAL_TEXTS]


def real_requests(prompts, temperature: float) -> list[tuple[list[int], SamplingParams]]:
    return [(p, SamplingParams(max_tokens=16, temperature=temperature, seed=100 + i, logprobs=True,
                               ignore_eos=True)) for i, p in enumerate(prompts)]


@pytest.mark.real_model
def test_smollm_greedy_alone_amid_others_from_the_prefix_cache_and_speculated_are_bit_identical(
        smollm_bf16_invariant):
    """Measured with BATCH_INVARIANT off: 3 of 5 such prompts changed logprobs amid the others (one its tokens),
    and all 5 with speculation on."""
    lm, prompts = smollm_bf16_invariant
    (alone, warm), cached, _ = run_rounds(lm, real_requests(prompts, 0.0), [False, True],
                                          prefix_cache_bytes=1 << 26)
    (speculated,), _, engine = run_rounds(lm, real_requests(prompts, 0.0), [True], speculative="ngram")
    assert all(n > 0 for n in cached[1]) and engine.metrics.accepted_tokens._value.get() > 0
    assert warm == alone and speculated == alone


@pytest.mark.real_model
def test_smollm_seeded_samples_repeat_alone_under_load_and_with_speculation(smollm_bf16_invariant):
    lm, prompts = smollm_bf16_invariant
    (alone, together), _, _ = run_rounds(lm, real_requests(prompts, 0.7), [False, True])
    (speculated,), _, engine = run_rounds(lm, real_requests(prompts, 0.7), [True], speculative="ngram")
    assert engine.metrics.accepted_tokens._value.get() > 0  # the repeated sentence's drafts
    assert together == alone and speculated == alone


@pytest.mark.full
@pytest.mark.parametrize("family", ["deepseek_v3", "gemma3_text", "gemma2"])
def test_other_attention_kinds_are_bit_identical_alone_and_amid_others(tiny_tokenizer, prompts, family):
    """deepseek_v3: multi-head latent attention (the pass cuts the keys the model expands from the joined latents);
    gemma3_text: sliding-window layers, whose caches keep only their window (a call's keys start past 0);
    gemma2: sliding windows on the eager function (soft-capping)."""
    model = build(family, len(tiny_tokenizer)).to(torch.bfloat16)
    make_linears_invariant(model, torch.bfloat16)
    lm = LoadedModel(model=model, tokenizer=tiny_tokenizer, name=family, max_context=256, eos_ids=(),
                     batch_invariant=True)
    (alone, together), _, engine = run_rounds(lm, greedy(prompts), [False, True])
    assert engine.batch_decode
    assert together == alone


@pytest.mark.full
@pytest.mark.parametrize("family", ["qwen2", "deepseek_v3", "gemma3_text", "gemma2"])
def test_invariant_attention_in_fp32_gives_generates_greedy_tokens(tiny_tokenizer, prompts, family):
    """The split into pieces and rows computes the same attention, only in fixed calls: the fp32 oracle holds."""
    model = build(family, len(tiny_tokenizer))
    expected = [model.generate(torch.tensor([p]), max_new_tokens=N, min_new_tokens=N, do_sample=False)[0, len(p):]
                .tolist() for p in prompts]
    lm = LoadedModel(model=model, tokenizer=tiny_tokenizer, name=family, max_context=256, eos_ids=(),
                     batch_invariant=True)
    (alone, together), _, _ = run_rounds(lm, greedy(prompts), [False, True])
    assert [[token for token, _ in answer] for answer in alone + together] == expected * 2


def test_tensor_parallel_followers_run_rank_0s_passes_invariant_too(tiny_tokenizer, prompts, monkeypatch):
    """Every rank must take the same attention calls (they run the same collectives): a follower replays rank 0's
    passes with the flag it loaded with (BATCH_INVARIANT comes from the same settings on every rank), and its
    copy of each request holds the tokens rank 0 fed."""
    import dataclasses

    import app.core.engine.tensor_parallel as tp
    from test_tensor_parallel import ListRanks

    lm = bf16_lm(tiny_tokenizer, True)
    ranks = ListRanks()
    run_rounds(dataclasses.replace(lm, ranks=ranks), greedy(prompts[:3]), [True])
    flags, real_pass = [], tp.run_pass
    monkeypatch.setattr(tp, "run_pass", lambda *args, **kwargs: (flags.append(args[4]),
                                                                 real_pass(*args, **kwargs))[1])
    held = tp.follow(dataclasses.replace(lm, ranks=ListRanks(ranks.sent)))
    assert flags and all(flags)
    (alone,), _, _ = run_rounds(lm, greedy(prompts[:3]), [False])
    for mirror in held.values():  # the requests that finished in the last step: their last token was never fed
        fed = mirror.token_ids[0, : mirror.cache.get_seq_length()].tolist()
        assert any(fed == p + [token for token, _ in answer[:-1]] for p, answer in zip(prompts, alone))
