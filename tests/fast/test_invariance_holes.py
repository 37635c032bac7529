"""Issue 58 finding 8, BATCH_INVARIANT's holes, each reproduced on the tiny model: a LoRA adapter's products (plain
matmuls over all of the adapter's rows in a pass), the lm_head at row counts past those its load-time check tried
(prompt-logprob chunks, verify rows, many streams), and a model the engine runs one request per pass, for which
`on` was still reported. The invariance of everything else: test_batch_invariance.py, test_invariant_linears.py."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import httpx
import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from app.config import Settings
from app.core.engine.engine import Engine
from app.core.sampling import SamplingParams
from app.errors import ConfigError
from app.main import create_app
from app.models import batch_rows, row_check
from app.models.invariance import resolve_batch_invariant
from app.models.loading import load_model
from app.models.lora import LoraAdapters
from app.models.lora_layers import LoraLinear, adapter_rows
from conftest import ThreadServer
from test_invariant_linears import rows_differ_from_alone
from test_lora import ALL_LINEARS, make_adapter

Answer = list[tuple[int, float]]  # (token id, its logprob) per generated token
LENGTHS = (3, 20, 45, 70)


def serve(lm, requests: list[tuple[list[int], SamplingParams, str | None]], together: bool,
          adapters: dict[str, str] | None = None, **engine_kwargs) -> list[tuple[Answer, list]]:
    """Each request's (tokens and logprobs, prompt logprobs) through one real Engine, with `adapters` (name ->
    directory) loaded at its start: all submitted at once (they share passes) or one after another."""
    registry = LoraAdapters("tiny", adapters) if adapters else None
    engine = Engine(lm, adapters=registry, **engine_kwargs)

    async def one(ids, params, name):
        handle = engine.submit(ids, params, adapter=registry.get(name) if name else None)
        events = [event async for event in handle]
        return [(e.token_id, e.logprob) for e in events], events[0].prompt_logprobs

    async def main():
        engine.start()
        await asyncio.to_thread(engine.loaded.wait)
        if engine.load_error is not None:
            raise engine.load_error
        try:
            if together:
                return await asyncio.gather(*(one(*request) for request in requests))
            return [await one(*request) for request in requests]
        finally:
            engine.stop()

    return asyncio.run(main())


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, len(tiny_tokenizer), (n,), generator=generator).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_tokenizer) -> str:
    path = tmp_path_factory.mktemp("invariant-lora") / "alpha"
    make_adapter(len(tiny_tokenizer), path, 3, ALL_LINEARS)
    return str(path)


def greedy(n: int = 8, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, logprobs=True, ignore_eos=True, **extra)


# ---- LoRA: an adapter's rows in checked calls ----

def test_an_adapters_answer_alone_and_amid_other_rows_is_bit_identical(tiny_dir, tiny_tokenizer, prompts,
                                                                       adapter_dir):
    """Three requests on one adapter and one on the base: together, the adapter's products take the rows of up to
    three requests a pass, alone one's. In fp32 MKL's `x @ A.T` of several rows sums otherwise than one row alone
    (from 2 rows on, on a Zen 4), so before the fix the adapter's logprobs differed amid the others."""
    lm = load_model(str(tiny_dir), device="cpu", dtype="float32", batch_invariant="on")
    adapters = {"alpha": adapter_dir}
    requests = [(ids, greedy(), name) for ids, name in zip(prompts, ("alpha", "alpha", None, "alpha"))]
    alone = serve(lm, requests, together=False, adapters=adapters, speculative="off")
    together = serve(lm, requests, together=True, adapters=adapters, speculative="off")
    assert together == alone  # every token id and logprob, exactly
    base = serve(lm, [(prompts[0], greedy(), None)], together=False, adapters=adapters, speculative="off")
    assert base[0][0] != alone[0][0]  # the adapter does change the answer: the comparison is not vacuous


def test_an_adapters_product_for_a_row_is_the_same_alone_side_by_side_and_spread_apart():
    """The layer itself: a row's output under BATCH_INVARIANT is the same in a pass of 1 row, 40 rows of the adapter
    side by side (a slice, added in place) and 40 spread apart (gathered, then scattered by index_add_)."""
    torch.manual_seed(0)
    layer = LoraLinear(row_check.RowSplitLinear(torch.nn.Linear(64, 128), "rows"), "proj")  # the base: per row
    adapter = SimpleNamespace(scale=1.5, weights={"proj": (torch.randn(8, 64), torch.randn(128, 8))})
    x = torch.randn(1, 40, 64)
    with torch.inference_mode():
        def run(spans, adapters):
            with adapter_rows(adapters, spans, torch.device("cpu"), invariant=True):
                return layer(x[:, : spans[-1][1]])[0]
        alone = run([(0, 1)], [adapter])  # row 0 alone
        side_by_side = run([(0, 40)], [adapter])
        spread = run([(0, 1), (1, 2), (2, 40)], [adapter, None, adapter])  # row 1 is the base's
        base = layer.base_layer(x[0])  # the base layer alone: what row 1 gets, nothing added
    assert torch.equal(side_by_side[:1], alone) and torch.equal(spread[:1], alone)
    assert torch.equal(spread[2:], side_by_side[2:]) and torch.equal(spread[1], base[1])


def test_auto_is_decided_knowing_lora_is_on(tiny_dir):
    cpu = torch.device("cpu")
    on, why = resolve_batch_invariant("auto", cpu, lora=True)
    assert on and "LoRA" in why
    assert "LoRA" not in resolve_batch_invariant("auto", cpu)[1]
    lm = load_model(str(tiny_dir), device="cpu", dtype="float32", lora=True)
    assert lm.batch_invariant and "LoRA" in lm.invariance


# ---- lm_head: every row count the engine can send it ----

VOCAB = 400  # the tiny model's lm_head: 400 x 64


@pytest.fixture
def head_varies_past_8_rows(monkeypatch):
    """oneDNN's packed kernel, made to compute a row otherwise past 8 rows, on the lm_head alone (within rounding,
    so the copy is kept); its check is cut to 1-8 rows, as the default model's 151,936 x 896 head's is by
    CHECK_MACS."""
    real = batch_rows.packed_linear

    def packed_linear(x, weight, bias):
        out = real(x, weight, bias)
        rows = x.numel() // x.shape[-1]
        return out * (1 + 1e-6 * max(0, rows - 8)) if out.shape[-1] == VOCAB else out

    monkeypatch.setattr(batch_rows, "packed_linear", packed_linear)
    up_to_8 = tuple(rows for rows in row_check.CHECK_ROWS if rows <= 8)
    monkeypatch.setattr(row_check, "CHECK_MACS", sum(max(n, 8) for n in row_check._calls(up_to_8)) * 64 * VOCAB)
    assert max(row_check.rows_to_check(64, VOCAB)) == 8


def test_the_lm_head_computes_a_row_the_same_way_past_the_row_counts_its_check_tried(tiny_dir,
                                                                                   head_varies_past_8_rows):
    lm = load_model(str(tiny_dir), device="cpu", dtype="float32", batch_invariant="on")
    head = lm.model.lm_head
    assert head.invariant == ("packed", "whole")  # the check passed it: it tried 1 to 8 rows
    assert rows_differ_from_alone(head, 64) == []  # 17, 64 and 129 rows too


def test_prompt_logprobs_alone_and_amid_others_are_bit_identical(tiny_dir, prompts, head_varies_past_8_rows):
    """A scored prompt sends the lm_head a row per prompt token (up to PROMPT_LOGPROBS_CHUNK, 256), amid other
    scored prompts more: 45 rows alone, 115 with the 70-token one."""
    lm = load_model(str(tiny_dir), device="cpu", dtype="float32", batch_invariant="on")
    requests = [(ids, greedy(2, prompt_logprobs=1), None) for ids in prompts[2:]]
    alone = serve(lm, requests, together=False)
    assert serve(lm, requests, together=True) == alone


# ---- a model the engine runs one request per pass: `on` cannot hold ----

def own_attention_lm(tiny_dir, **kwargs):
    """The tiny model on an attention function the packed pass does not know (as flash attention would be): the
    engine runs it one request per pass, whose prompt chunks (and so their attention) depend on what else
    prefills."""
    AttentionInterface.register("tiny_own_sdpa", sdpa_attention_forward)
    lm = load_model(str(tiny_dir), device="cpu", dtype="float32", **kwargs)
    lm.model.set_attn_implementation("tiny_own_sdpa")
    return lm


def test_on_is_refused_where_the_engine_runs_one_request_per_pass(tiny_dir):
    lm = own_attention_lm(tiny_dir, batch_invariant="on")
    with pytest.raises(ConfigError) as caught:
        serve(lm, [], together=False)
    assert caught.value.param == "batch_invariant" and "one request per pass" in str(caught.value)


def test_auto_turns_off_where_the_engine_runs_one_request_per_pass_and_says_so(tiny_dir, caplog):
    lm = own_attention_lm(tiny_dir)  # auto: on for a CPU in fp32, until the engine finds it cannot hold
    assert lm.batch_invariant
    with caplog.at_level(logging.WARNING, logger="app.models.loading"):
        with ThreadServer(create_app(Settings(model="tiny"), lm=lm)) as server:
            ready = httpx.get(f"{server.url}/ready").json()
            listed = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert not lm.batch_invariant and lm.invariance.startswith("auto: off, since this model runs one request")
    assert ready["batch_invariance"] == listed["batch_invariance"] == f"off: {lm.invariance}"
    assert "batch invariance off: auto: off, since" in caplog.text
