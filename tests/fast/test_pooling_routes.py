"""Hostile input on the pooling routes (/v1/embeddings, /v1/rerank, /v1/score), over a real socket: a RoBERTa-family
reranker's real limit (two fewer than max_position_embeddings) and a row that fails alone hurt only their own
request, never the others in its pass; deadlines answer as on the generation routes; the routes' own input bounds
(not MAX_MESSAGES), both sides of a bi-encoder's score counted, and truncation that keeps the last tokens.

Requests are made to share a pass by holding the engine's first pass (`held_engine`) until they are all queued."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import httpx
import numpy as np
import pytest
import torch

from app.config import Settings
from app.core.engine.embedding import EmbeddingEngine, EmbeddingFailed
from app.main import create_app
from app.metrics import parse_samples
from app.models.loading import load_model
from app.openai.embeddings import serving

from conftest import ThreadServer
from embedding_models import (build_tiny_bert_dir, build_tiny_cross_encoder_dir, build_tiny_xlm_roberta_dir,
                              decoder_embedder_dir)

WORDS_600 = " ".join(["paris"] * 600)
SHORT = ["Paris is the capital of France.", "hello", "the city on the seine"]


@pytest.fixture(scope="module")
def bert_server(tmp_path_factory):
    path = build_tiny_bert_dir(tmp_path_factory.mktemp("tiny-bert"))
    with ThreadServer(create_app(Settings(model=str(path)), lm=load_model(str(path), device="cpu"))) as server:
        yield server


@pytest.fixture(scope="module")
def reranker_server(tmp_path_factory):
    path = build_tiny_xlm_roberta_dir(tmp_path_factory.mktemp("tiny-xlmr-reranker"))
    with ThreadServer(create_app(Settings(model=str(path)), lm=load_model(str(path), device="cpu"))) as server:
        yield server


def post(server, path: str, headers: dict | None = None, **body) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=180)


def metrics(server) -> dict[str, float]:
    return parse_samples(httpx.get(server.url + "/metrics").text)


@contextlib.contextmanager
def held_engine(server, queued: int, hold_s: float = 0.02):
    """The engine's next pass waits until `queued` more requests wait behind it (and `hold_s` more: past a 1 ms
    deadline, for certain), so those share the pass after it. Yields a function that posts a request in a thread
    and returns a callable giving its response."""
    engine, lm = server.state.engine, server.state.engine.lm
    gate, entered = threading.Event(), threading.Event()
    real = lm.embed

    def embed(rows):
        if not gate.is_set():
            entered.set()
            gate.wait(120)  # released once the others queue; a loaded machine may take a while
        return real(rows)

    lm.embed = embed
    threads: list[threading.Thread] = []

    def send(path: str, headers: dict | None = None, **body):
        box = {}
        thread = threading.Thread(target=lambda: box.setdefault("r", post(server, path, headers, **body)))
        thread.start()
        threads.append(thread)
        return lambda: (thread.join(180), box["r"])[1]

    try:
        send("/v1/score" if lm.scores_pairs else "/v1/embeddings",
             **({"text_1": "a", "text_2": "b"} if lm.scores_pairs else {"input": "blocker"}))
        assert entered.wait(60), "the blocker's pass never started"
        yield send
        deadline = time.monotonic() + 60
        while engine.in_flight < 1 + queued and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.in_flight == 1 + queued, f"{engine.in_flight} in flight, expected {1 + queued}"
        time.sleep(hold_s)
    finally:
        gate.set()
        for thread in threads:
            thread.join(180)
        lm.embed = real


# ---- finding 1: a model's real limit, and one input never fails its pass ----

@pytest.mark.full
def test_a_roberta_family_model_takes_two_fewer_tokens_than_its_position_table(tmp_path):
    reranker = load_model(str(build_tiny_xlm_roberta_dir(tmp_path / "reranker")), device="cpu")
    assert reranker.model.config.max_position_embeddings == 34 and reranker.max_context == 32
    encoder = load_model(str(build_tiny_xlm_roberta_dir(tmp_path / "encoder", cross_encoder=False)), device="cpu")
    assert encoder.max_context == 32  # no sentence_bert_config.json: read from the model
    row = encoder.encode_text(WORDS_600, encoder.max_context)
    assert len(row) == 32 and encoder.embed([row]).isfinite().all()
    # the tokenizer's own model_max_length, when it declares one, is respected too
    (tmp_path / "encoder" / "tokenizer_config.json").write_text(
        (tmp_path / "encoder" / "tokenizer_config.json").read_text().replace(
            '"model_max_length": 1000000000000000019884624838656', '"model_max_length": 16'))
    assert load_model(str(tmp_path / "encoder"), device="cpu").max_context == 16


@pytest.mark.full
def test_a_model_of_64_positions_starts_through_the_servers_own_loading_and_answers(tmp_path):
    """Issue 58, item 10: a pooling model whose limit is under 128 tokens (a 64-position reranker) must start as a
    new user starts it (MODEL=dir, the server loading it), not fail at load on a wider row than it holds."""
    reranker = build_tiny_cross_encoder_dir(tmp_path / "reranker", positions=64)
    embedder = build_tiny_bert_dir(tmp_path / "embedder", positions=64, sentence_transformers=False)
    for path, route, body in ((reranker, "/v1/rerank", {"query": "paris", "documents": SHORT}),
                              (embedder, "/v1/embeddings", {"input": SHORT})):
        with ThreadServer(create_app(Settings(model=str(path)))) as server:
            assert httpx.get(f"{server.url}/ready").status_code == 200
            assert server.state.lm.max_context == 64
            answer = post(server, route, **body)
            assert answer.status_code == 200, answer.text
            assert len(answer.json()["results" if route == "/v1/rerank" else "data"]) == len(SHORT)
            too_long = {**body, "documents": [WORDS_600]} if route == "/v1/rerank" else {"input": WORDS_600}
            assert post(server, route, **too_long).status_code == 400  # past its 64: refused, never run
            cut = post(server, route, **too_long, truncate_prompt_tokens=-1)
            assert cut.status_code == 200 and cut.json()["usage"]["total_tokens"] == 64
            assert post(server, route, **body).status_code == 200


@pytest.mark.full
def test_a_reranker_pair_truncated_to_the_model_limit_scores_beside_its_pass(reranker_server):
    lm = reranker_server.state.engine.lm
    passes = reranker_server.state.engine.passes
    with held_engine(reranker_server, queued=4) as send:
        long = send("/v1/rerank", query=WORDS_600, documents=[WORDS_600], truncate_prompt_tokens=-1)
        others = [send("/v1/rerank", query="paris", documents=SHORT),
                  send("/v1/score", text_1="paris", text_2=SHORT[:2]),
                  send("/v1/rerank", query="hello", documents=[WORDS_600], truncate_prompt_tokens=10)]
    answer = long()
    assert answer.status_code == 200, answer.text
    assert reranker_server.state.engine.passes == passes + 2, "the four waiting requests shared one pass"
    assert answer.json()["usage"]["total_tokens"] == lm.max_context == 32
    assert 0 < answer.json()["results"][0]["relevance_score"] < 1
    rerank, score, cut = (get() for get in others)
    for response in (rerank, score, cut):
        assert response.status_code == 200, response.text
    alone = post(reranker_server, "/v1/rerank", query="paris", documents=SHORT).json()["results"]
    np.testing.assert_allclose([r["relevance_score"] for r in rerank.json()["results"]],
                               [r["relevance_score"] for r in alone], atol=1e-6)
    assert cut.json()["usage"]["total_tokens"] == 10


@pytest.mark.full
def test_a_row_that_fails_alone_fails_only_its_request(bert_server):
    """An injected failure for one row (an id no real input has: a stand-in for an input the model cannot take):
    its request gets a 500 in OpenAI's shape; the other requests in its pass get the vectors they get alone."""
    poison = [2, 7, 7, 7, 7, 3]
    lm = bert_server.state.engine.lm
    real = lm.embed
    expected = [post(bert_server, "/v1/embeddings", input=text).json()["data"][0]["embedding"] for text in SHORT]

    def failing_for_poison(rows):
        if poison in rows:
            raise RuntimeError("an input this model cannot take")
        return real(rows)

    with held_engine(bert_server, queued=4) as send:
        lm.embed = failing_for_poison  # from the pass after the held one; held_engine puts `real` back
        others = [send("/v1/embeddings", input=text) for text in SHORT]
        failing = send("/v1/embeddings", input=[poison])
    bad = failing()
    assert bad.status_code == 500 and "cannot take" in bad.json()["error"]["message"], bad.text
    for get, vector in zip(others, expected):
        response = get()
        assert response.status_code == 200, response.text
        np.testing.assert_allclose(response.json()["data"][0]["embedding"], vector, atol=1e-6)


def test_the_engine_runs_a_failed_pass_again_in_halves_down_to_the_failing_row(tmp_path):
    lm = load_model(str(build_tiny_bert_dir(tmp_path / "bert")), device="cpu")
    rows = [lm.encode_text(t) for t in SHORT] + [[2, 7, 3]] + [lm.encode_text("one more")]
    calls: list[int] = []

    class Failing:
        def embed(self, batch):
            calls.append(len(batch))
            if [2, 7, 3] in batch:
                raise ValueError("row 3 fails")
            return lm.embed(batch)

    async def run():
        release = threading.Event()
        engine = EmbeddingEngine(lambda: (release.wait(10), Failing())[1])
        engine.start()
        pending = [asyncio.ensure_future(engine.embed([row])) for row in rows]
        await asyncio.sleep(0.05)
        release.set()
        results = await asyncio.gather(*pending, return_exceptions=True)
        engine.stop()
        return results

    results = asyncio.run(run())
    assert isinstance(results[3], EmbeddingFailed) and "row 3 fails" in str(results[3])
    for i in (0, 1, 2, 4):
        torch.testing.assert_close(results[i][0], lm.embed([rows[i]])[0], atol=1e-6, rtol=1e-5)
    assert calls[0] == 5 and calls.count(1) >= 1 and len(calls) <= 7, calls  # 5, then 3+2, then 2+1 ... not 5 singles


def test_a_truncated_request_never_lends_its_cut_to_a_concurrent_one(reranker_server, bert_server):
    """Prepare workers tokenize side by side; the tokenizer's own truncation is state they would share (a pair cut to
    32 came back whole 4 times in 500 beside uncut calls, at a 1 us switch interval)."""
    import sys

    pairs, texts = reranker_server.state.engine.lm, bert_server.state.engine.lm
    long = " ".join(["paris"] * 60)
    whole_pair, whole_text = len(pairs.encode_pair(long, "hello")), len(texts.encode_text(long))
    wrong: list[tuple[str, int]] = []

    def cut():
        for _ in range(300):
            wrong.extend(("pair", n) for n in [len(pairs.encode_pair(long, long, 32))] if n != 32)
            wrong.extend(("text", n) for n in [len(texts.encode_text(long, 10))] if n != 10)

    def whole():
        for _ in range(300):
            wrong.extend(("pair", n) for n in [len(pairs.encode_pair(long, "hello"))] if n != whole_pair)
            wrong.extend(("text", n) for n in [len(texts.encode_text(long))] if n != whole_text)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=f) for f in (cut, whole)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        sys.setswitchinterval(interval)
    assert not wrong, wrong[:5]
    short = post(reranker_server, "/v1/rerank", query="q", documents=["d"], truncate_prompt_tokens=3)
    assert short.status_code == 400 and short.json()["error"]["param"] == "truncate_prompt_tokens", short.text


# ---- finding 7: deadlines ----

ROUTES = [("/v1/embeddings", {"input": "hello"}), ("/v1/rerank", {"query": "q", "documents": ["d", "e"]}),
          ("/v1/score", {"text_1": "a", "text_2": ["b", "c"]})]


@pytest.mark.full
def test_a_request_timeout_header_ends_each_pooling_route_like_a_queued_generation(bert_server):
    before = metrics(bert_server).get('simple_serve_deadlines_exceeded_total{stage="queue"}', 0)
    with held_engine(bert_server, queued=3) as send:
        late = [send(path, {"x-request-timeout": "0.001"}, **body) for path, body in ROUTES]
    for (path, _), get in zip(ROUTES, late):
        r = get()
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout", (path, r.text)
        assert r.headers["retry-after"] == "1", path
    assert metrics(bert_server)['simple_serve_deadlines_exceeded_total{stage="queue"}'] - before == 3
    for path, body in ROUTES:
        bad = post(bert_server, path, {"x-request-timeout": "soon"}, **body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-request-timeout", (path, bad.text)
        assert post(bert_server, path, {"x-request-timeout": "30"}, **body).status_code == 200, path


@pytest.mark.full
def test_queue_and_request_timeouts_apply_to_the_pooling_routes(tmp_path):
    path = build_tiny_bert_dir(tmp_path / "bert")
    lm = load_model(str(path), device="cpu")
    for setting in ({"queue_timeout_s": 1.0}, {"request_timeout_s": 1.0}):
        with ThreadServer(create_app(Settings(model=str(path), **setting), lm=lm)) as server:
            assert post(server, "/v1/embeddings", input="quick").status_code == 200, setting
            with held_engine(server, queued=3, hold_s=1.3) as send:
                late = [send(route, **body) for route, body in ROUTES]
            for (route, _), get in zip(ROUTES, late):
                r = get()
                assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout", (setting, route, r.text)


# ---- finding 6 and 7: the routes' own bounds, both sides counted, truncation keeps the last tokens ----

@pytest.mark.full
def test_one_long_token_id_list_cut_by_truncate_prompt_tokens_is_served(tiny_dir, tmp_path, tiny_tokenizer):
    """3,000 ids are one input, not 3,000 messages: no MAX_MESSAGES. The cut keeps the last 256, so a last-token
    pooling still reads the EOS the list ends with."""
    path = decoder_embedder_dir(tiny_dir, tmp_path / "decoder-embedder")
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [int(i) for i in torch.randint(3, 300, (2999,), generator=torch.Generator().manual_seed(0))] + [eos]
    with ThreadServer(create_app(Settings(model=str(path)), lm=load_model(str(path), device="cpu"))) as server:
        r = post(server, "/v1/embeddings", input=ids, truncate_prompt_tokens=256)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 256
        last = post(server, "/v1/embeddings", input=ids[-256:]).json()["data"][0]["embedding"]
        first = post(server, "/v1/embeddings", input=ids[:256]).json()["data"][0]["embedding"]
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], last, atol=1e-6)
        assert not np.allclose(last, first, atol=1e-3)


def test_truncation_keeps_the_last_tokens_of_texts_and_token_lists_alike(bert_server):
    lm = bert_server.state.engine.lm
    text = " ".join(f"w{i}" for i in range(100))
    ids = lm.encode_text(text)
    cut = lm.encode_text(text, 10)
    assert len(cut) == 10 and cut[0] == ids[0] and cut[-1] == ids[-1] and cut[1:-1] == ids[-9:-1]
    assert lm.cut_ids(ids, 10) == cut  # [CLS] kept in front, as the text's cut keeps it
    by_text = post(bert_server, "/v1/embeddings", input=text, truncate_prompt_tokens=10).json()["data"][0]
    by_ids = post(bert_server, "/v1/embeddings", input=ids, truncate_prompt_tokens=10).json()["data"][0]
    exact = post(bert_server, "/v1/embeddings", input=cut).json()["data"][0]
    np.testing.assert_allclose(by_text["embedding"], exact["embedding"], atol=1e-6)
    np.testing.assert_allclose(by_ids["embedding"], exact["embedding"], atol=1e-6)


def test_a_bi_encoder_score_counts_both_sides_against_the_limits(bert_server, monkeypatch):
    half = serving.MAX_INPUTS // 2 + 1  # each side under MAX_INPUTS, both together over it
    r = post(bert_server, "/v1/score", text_1=["x"] * half, text_2=["y"] * half)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "too_many_items" and "MAX_INPUTS" in error["message"] and error["param"] == "text_2"
    r = post(bert_server, "/v1/rerank", query="q", documents=["d"] * serving.MAX_INPUTS)
    assert r.status_code == 400 and "MAX_INPUTS" in r.json()["error"]["message"], r.text
    monkeypatch.setattr(serving, "MAX_TOTAL_TOKENS", 20)  # 4 texts of 4 tokens a side: 16 each, 32 together
    r = post(bert_server, "/v1/score", text_1=["a b"] * 4, text_2=["c d"] * 4)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "too_many_tokens" and "MAX_TOTAL_TOKENS" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "text_2"


@pytest.mark.full
def test_the_pooling_routes_bound_their_own_lists_before_parsing(bert_server):
    too_many = serving.MAX_INPUTS + 1
    for path, body, param, setting in [
            ("/v1/embeddings", {"input": ["x"] * too_many}, "input", "MAX_INPUTS"),
            ("/v1/embeddings", {"input": [1] * (serving.MAX_TOTAL_TOKENS + 1)}, "input", "MAX_TOTAL_TOKENS"),
            ("/v1/rerank", {"query": "q", "documents": ["d"] * too_many}, "documents", "MAX_INPUTS"),
            ("/v1/score", {"text_1": "q", "text_2": ["d"] * too_many}, "text_2", "MAX_INPUTS")]:
        r = post(bert_server, path, **body)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error["param"] == param and setting in error["message"] and "MAX_MESSAGES" not in error["message"]
