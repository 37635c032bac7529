"""The token inspector: each sampling stage recorded by the pass that chose the token, in core, over HTTP, in the CLI.

Tiny model only; a few seconds.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from app.__main__ import main
from app.cli import format_inspection
from app.core.generate import generate
from app.core.sampling import SamplingParams, inspect_stages, make_generator, process_logits, sample

CHAT = "/v1/chat/completions"
SAMPLED_STAGES = ["raw", "penalties", "temperature", "top_k", "top_p", "min_p"]
# Qwen2.5's generation_config.json: the settings with which the old --show-logits listed top-p's zeros
QWEN_DEFAULTS = dict(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.1)


def prompt(lm, text: str = "Which city is the capital of France?") -> list[int]:
    return lm.encode_chat([{"role": "user", "content": text}])


def run(lm, ids, **params):
    return list(generate(lm.model, lm.tokenizer, ids, SamplingParams(**params), lm.eos_ids, lm.max_context))


def peaked_logits(vocab: int = 50, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(1, vocab) * 4


def test_recording_is_the_same_pass_and_changes_nothing():
    logits, seen = peaked_logits(), torch.tensor([[3, 7, 7, 11]])
    params = SamplingParams(min_p=0.05, **QWEN_DEFAULTS)
    stages: list = []
    recorded = process_logits(logits, params, seen, seen[:, 2:], [5], stages=stages)
    assert [name for name, _ in stages] == SAMPLED_STAGES
    assert torch.equal(recorded, process_logits(logits, params, seen, seen[:, 2:], [5]))
    assert stages[0][1] is logits and stages[-1][1] is recorded  # raw in, drawn-from scores out: no copies
    # each stage only ever removes tokens from the one before (temperature keeps them all)
    alive = [torch.isfinite(scores) for _, scores in stages[1:]]
    assert all(bool((later <= earlier).all()) for earlier, later in zip(alive, alive[1:]))
    assert not alive[0][0, 5]  # the banned token is impossible from the penalties stage on


def test_greedy_records_only_the_stages_it_runs():
    stages: list = []
    process_logits(peaked_logits(), SamplingParams(do_sample=False, repetition_penalty=1.3),
                   torch.tensor([[1, 2]]), torch.tensor([[2]]), stages=stages)
    assert [name for name, _ in stages] == ["raw", "penalties"]


def test_candidates_follow_the_penalised_order_and_are_never_impossible():
    logits = peaked_logits(vocab=12)
    params = SamplingParams(**QWEN_DEFAULTS)
    stages: list = []
    scores = process_logits(logits, params, torch.tensor([[0]]), torch.tensor([[0]]), [1, 2], stages=stages)
    chosen = int(sample(scores, params, make_generator(0, "cpu")))
    inspection = inspect_stages(stages, chosen, top=20)  # more than the 12 tokens there are
    penalties = [row[1] for row in inspection.probs]
    assert penalties == sorted(penalties, reverse=True)
    assert sorted(inspection.token_ids) == list(range(12))  # the banned 1 and 2 too: the model ranks them
    assert penalties[-2:] == [0, 0] and set(inspection.token_ids[-2:]) == {1, 2}  # ... and the ban shows as a cut
    expected = torch.stack([s[0].softmax(-1) for _, s in stages])[:, inspection.token_ids].T
    assert torch.allclose(torch.tensor(inspection.probs), expected)
    assert inspection.probs[inspection.token_ids.index(chosen)][-1] > 0  # what was drawn survived every cut


def test_a_penalised_favourite_stays_in_view():
    """A strong repetition penalty can push the model's favourite out of the top: it is listed all the same."""
    logits = torch.tensor([[9.0, 2.0, 1.9, 1.8, 1.7, 0.0]])
    params = SamplingParams(do_sample=False, repetition_penalty=6.0)
    stages: list = []
    scores = process_logits(logits, params, torch.tensor([[0]]), torch.tensor([[0]]), stages=stages)
    inspection = inspect_stages(stages, int(scores.argmax()), top=2)
    assert inspection.token_ids == [1, 2, 0] and inspection.chosen == 1
    raw, penalised = zip(*inspection.probs)
    assert raw[2] > 0.99 and penalised[2] < penalised[1]


def test_only_impossible_tokens_are_left_out():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5]])
    stages: list = []
    process_logits(logits, SamplingParams(), torch.tensor([[0]]), torch.tensor([[0]]), [2, 3], stages=stages)
    inspection = inspect_stages(stages, chosen=0, top=2)
    assert inspection.token_ids == [0, 1]  # 2 and 3 are impossible, and the model did not rank them top-2 either


def test_a_lowly_drawn_token_is_listed_too():
    logits = torch.zeros(1, 30)  # uniform: any token may be drawn, most rank below the top 3
    params = SamplingParams(temperature=1.0)
    stages: list = []
    process_logits(logits, params, torch.tensor([[0]]), torch.tensor([[0]]), stages=stages)
    inspection = inspect_stages(stages, chosen=29, top=3)
    assert inspection.token_ids[-1] == 29 and len(inspection.token_ids) == 4


def test_generation_with_the_inspector_draws_the_same_tokens(tiny_lm):
    ids = prompt(tiny_lm)
    plain = run(tiny_lm, ids, max_tokens=12, seed=7, ignore_eos=True, logprobs=True, **QWEN_DEFAULTS)
    seen = run(tiny_lm, ids, max_tokens=12, seed=7, ignore_eos=True, logprobs=True, inspect=5, **QWEN_DEFAULTS)
    assert [e.token_id for e in seen] == [e.token_id for e in plain]
    for e in seen:
        ins = e.inspection
        assert ins.stages == SAMPLED_STAGES and ins.chosen == e.token_id and e.token_id in ins.token_ids
        row = ins.probs[ins.token_ids.index(e.token_id)]
        assert row[0] == pytest.approx(math.exp(e.logprob), rel=1e-4)  # raw stage = the model's own distribution
        assert row[-1] > 0
        assert all(p[1] > 0 for p in ins.probs)
    assert all(e.inspection is None for e in plain)


def test_greedy_inspection_picks_the_best_penalised_token(tiny_lm):
    events = run(tiny_lm, prompt(tiny_lm), max_tokens=6, do_sample=False, repetition_penalty=1.3, inspect=4,
                 ignore_eos=True)
    for e in events:
        ins = e.inspection
        assert ins.stages == ["raw", "penalties"] and ins.token_ids[0] == e.token_id


def test_api_streams_an_inspection_with_every_token(make_tiny_server, tiny_lm):
    server = make_tiny_server()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Which city is the capital of France?"}],
            "max_tokens": 10, "seed": 3, "ignore_eos": True, "inspect": {"top": 4}}
    with httpx.stream("POST", server.url + CHAT, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    entries = [c["choices"][0]["inspect"] for c in chunks if "inspect" in c["choices"][0]]
    assert len(entries) == 10
    for entry in entries:
        assert entry["stages"] == SAMPLED_STAGES
        assert 4 <= len(entry["candidates"]) <= 2 * 4 + 1  # top 4 penalised, + raw favourites, + the drawn one
        drawn = [c for c in entry["candidates"] if c["id"] == entry["token"]["id"]]
        assert len(drawn) == 1 and drawn[0]["probs"][-1] > 0 and drawn[0]["text"] == entry["token"]["text"]
    streamed_text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert streamed_text == tiny_lm.tokenizer.decode([e["token"]["id"] for e in entries])  # one entry per token

    # Same seed: the same tokens and the same tables. The second request's prompt comes from the prefix cache, and
    # prefilling the rest as a chunk may round the last float32 bits differently (docs/performance.md: prefix caching), so the
    # probabilities are compared to 1e-4 and everything else exactly.
    full = httpx.post(server.url + CHAT, json=body).json()
    assert full["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for got, want in zip(full["choices"][0]["inspect"], entries, strict=True):
        assert got["token"] == want["token"] and got["stages"] == want["stages"]
        assert [(c["id"], c["text"]) for c in got["candidates"]] == [(c["id"], c["text"]) for c in want["candidates"]]
        for c, w in zip(got["candidates"], want["candidates"]):
            assert c["probs"] == pytest.approx(w["probs"], abs=1e-4)

    plain = httpx.post(server.url + CHAT, json={**body, "inspect": None}).json()
    assert "inspect" not in plain["choices"][0]  # off by default
    assert plain["choices"][0]["message"] == full["choices"][0]["message"]


def test_legacy_completions_inspect_too(make_tiny_server):
    server = make_tiny_server()
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "The capital of France",
                                                         "max_tokens": 3, "temperature": 0, "inspect": {}})
    inspect = r.json()["choices"][0]["inspect"]
    assert len(inspect) == 3 and inspect[0]["stages"] == ["raw", "penalties"]
    assert 10 <= len(inspect[0]["candidates"]) <= 21  # the default top is 10


@pytest.mark.parametrize("inspect, param", [({"top": 0}, "inspect.top"), ({"top": 21}, "inspect.top"),
                                            ({"tpo": 3}, "inspect.tpo"), (5, "inspect")])
def test_bad_inspect_gets_a_400_naming_it(make_tiny_server, inspect, param):
    server = make_tiny_server()
    r = httpx.post(server.url + CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                            "inspect": inspect})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_models_lists_the_effective_sampling_defaults(make_tiny_server):
    server = make_tiny_server()
    model = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert model["sampling_defaults"] == {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
                                          "min_p": 0.0, "repetition_penalty": 1.1, "presence_penalty": 0.0,
                                          "frequency_penalty": 0.0}


def test_cli_table_marks_the_drawn_token_and_the_cuts(tiny_lm):
    events = run(tiny_lm, prompt(tiny_lm), max_tokens=3, seed=1, inspect=5, ignore_eos=True, **QWEN_DEFAULTS)
    table = format_inspection(events[0].inspection, tiny_lm.tokenizer).splitlines()
    assert table[0].split() == SAMPLED_STAGES
    rows = table[1:]
    assert len(rows) == len(events[0].inspection.token_ids)
    assert sum(row.startswith("    *") for row in rows) == 1
    for row, probs in zip(rows, events[0].inspection.probs):
        cells = row.split()[-6:]
        assert [c == "-" for c in cells] == [p == 0 for p in probs]  # "-": this stage cut the token


def test_cli_rejects_a_bad_show_logits_before_loading(capsys):
    assert main(["generate", "hi", "--model", "/no/such/model", "--show-logits", "0"]) == 2
    assert "--show-logits" in capsys.readouterr().err
