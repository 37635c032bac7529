"""Tensor parallelism (app/models/distributed.py, app/core/engine/tensor_parallel.py).

The fast tests need no second process: rank 0's engine sends its step messages into a list, and a follower replays
them on its own copy of the model, which must end up holding exactly what rank 0 fed. The slow ones start real
ranks with torchrun over gloo on this CPU (tests/server/test_tensor_parallel_ranks.py).
"""

from __future__ import annotations

import collections
import dataclasses
import json

import httpx
import pytest
from transformers import GPT2Config, LlamaConfig, Qwen2Config

from app.__main__ import main
from app.config import Settings
from app.core.sampling import SamplingParams
from app.core.engine.tensor_parallel import follow
from app.errors import ConfigError
from app.models.distributed import tp_plan_problem
from app.models.loading import load_model

from conftest import ThreadServer
from engine_runs import run_engine

CHAT = "/v1/chat/completions"


class ListRanks:
    """Stands in for app.models.distributed.Ranks on both sides: rank 0's messages go into a list that a
    follower then receives in order."""

    rank, size = 0, 2

    def __init__(self, messages: list | None = None):
        self.sent: list = []
        self.inbox = list(messages or []) + [("stop",)]
        self.lost: str | None = None
        self.fail_next_send = False

    def send(self, message) -> None:
        if self.fail_next_send:
            self.lost = "RuntimeError: Connection closed by peer (simulated)"
            raise RuntimeError(self.lost)
        self.sent.append(message)

    def receive(self):
        return self.inbox.pop(0)

    def start_heartbeat(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_models_without_a_plan_are_refused_by_name():
    assert "no tensor-parallel plan" in tp_plan_problem(GPT2Config(), 2, "my-gpt2")
    assert "'my-gpt2'" in tp_plan_problem(GPT2Config(), 2, "my-gpt2")
    # SmolLM2-135M's shape: 9 heads, 3 key/value heads
    why = tp_plan_problem(LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3), 2, "smollm2")
    assert "9 attention heads" in why and "do not divide evenly over 2 ranks" in why
    assert tp_plan_problem(LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3), 3, "smollm2") is None
    assert tp_plan_problem(Qwen2Config(num_attention_heads=14, num_key_value_heads=2), 2, "qwen") is None


def test_load_model_refuses_a_model_without_a_plan_before_joining_any_rank(tmp_path, tiny_tokenizer):
    from transformers import GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=len(tiny_tokenizer))).save_pretrained(
        tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="has no tensor-parallel plan") as err:
        load_model(str(tmp_path), device="cpu", dtype="float32", tensor_parallel=2)
    assert str(tmp_path) in err.value.message and err.value.param == "tensor_parallel"


def test_tensor_parallel_without_torchrun_says_how_to_launch(monkeypatch, capsys):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert main(["serve", "--tensor-parallel", "2", "--model", "whatever"]) == 2
    assert "torchrun --nproc-per-node 2 -m app serve --tensor-parallel 2" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert main(["serve", "--tensor-parallel", "2", "--model", "whatever"]) == 2
    assert "torchrun started 3 processes" in capsys.readouterr().err


PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22], list(range(30, 60)), [7, 7, 7, 7, 7, 7, 7, 7]]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one-per-pass"])
def test_follower_replays_every_pass_of_rank0(tiny_lm, packed):
    """Concurrent requests of different lengths, chunked prefill, n-gram drafts cropped after verification: the
    follower's copy of each request holds exactly the tokens rank 0 fed, its caches agree in length at every pass
    (`Mirror.feed` raises otherwise), and the caches of finished requests are dropped."""
    ranks = ListRanks()
    leader_lm = dataclasses.replace(tiny_lm, ranks=ranks)
    requests = [(ids, SamplingParams(max_tokens=n, do_sample=False, ignore_eos=True))
                for ids, n in zip(PROMPTS, (12, 30, 5, 40))]
    seen, _ = run_engine(leader_lm, requests, together=True, speculative="ngram", prefill_tokens_per_step=16,
                         packed_batching=packed)
    alone, _ = run_engine(tiny_lm, requests, together=True, speculative="off", packed_batching=packed)
    assert [s.tokens for s in seen] == [s.tokens for s in alone]  # the hook changes nothing on rank 0
    passes = [m for m in ranks.sent if m[0] == "pass"]
    if packed:  # speculation needs the packed pass (app/core/engine/engine.py)
        assert any(row[3] > 1 for m in passes for row in m[3]), "some pass verified drafts"
    chunks = collections.Counter(row[0] for m in passes for row in m[3] if row[3] == 1 and len(row[2]) > 1)
    assert max(chunks.values()) > 1, "some prompt was fed in several prefill chunks"

    held = follow(dataclasses.replace(tiny_lm, ranks=ListRanks(ranks.sent)))
    dropped = {key for m in passes for key in m[1]}
    assert len(dropped) + len(held) == len(requests) and not dropped & set(held)
    for mirror in held.values():  # still held: the requests that finished in the last step
        (ids, _), out = next((r, s) for r, s in zip(requests, seen) if r[0] == mirror.token_ids[0, :len(r[0])].tolist())
        fed = ids + out.tokens[:-1]  # the last token is returned, never fed
        assert mirror.token_ids[0, :len(fed)].tolist() == fed
        assert mirror.cache.get_seq_length() == len(fed)


def tp_server(tiny_lm, ranks) -> ThreadServer:
    from app.main import create_app

    app = create_app(Settings(model="tiny", tensor_parallel=2), lm=dataclasses.replace(tiny_lm, ranks=ranks))
    return ThreadServer(app).__enter__()


def body(**extra):
    return {"model": "tiny", "messages": [{"role": "user", "content": "Which city is the capital of France?"}],
            "temperature": 0, "max_tokens": 12, "ignore_eos": True, **extra}


def test_a_rank_lost_mid_stream_ends_it_cleanly_and_the_server_turns_not_ready(tiny_lm):
    ranks = ListRanks()
    server = tp_server(tiny_lm, ranks)
    try:
        assert server.state.engine.prefix_cache is None  # off under tensor parallelism
        assert httpx.post(server.url + CHAT, json=body(), timeout=60).status_code == 200
        with httpx.stream("POST", server.url + CHAT, json=body(stream=True, max_tokens=40), timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            assert json.loads(first[6:])["choices"]  # the stream has started
            ranks.fail_next_send = True  # the next pass's broadcast finds a peer gone
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert "rank" in error["message"] and "Connection closed by peer" in error["message"]
        for probe in ("/health", "/ready"):
            r = httpx.get(server.url + probe)
            assert r.status_code == 503 and r.json()["status"] == "dead", probe
        r = httpx.post(server.url + CHAT, json=body())
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    finally:
        server.__exit__()


def test_a_rank_lost_while_idle_turns_the_server_not_ready(tiny_lm):
    ranks = ListRanks()
    server = tp_server(tiny_lm, ranks)
    try:
        assert httpx.get(server.url + "/ready").status_code == 200
        ranks.lost = "RuntimeError: Connection closed by peer (the heartbeat's send)"
        for probe in ("/health", "/ready"):
            r = httpx.get(server.url + probe)
            assert r.status_code == 503 and "tensor-parallel rank is gone" in r.json()["error"], probe
        r = httpx.post(server.url + CHAT, json=body())
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    finally:
        server.__exit__()
