"""/v1/embeddings, /v1/rerank and /v1/score over a real socket, served by a tiny random BERT built in the test (and
a tiny cross-encoder): what a client sees (shapes, base64, usage, ordering, limits and their 400s), and what a chat
model or an embedding model says when asked for the other's endpoints."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from app.config import Settings
from app.main import create_app
from app.metrics import parse_samples
from app.models.loading import load_model
from app.openai.embeddings import serving

from conftest import ThreadServer
from embedding_models import MAX_SEQ_LENGTH, build_tiny_bert_dir, build_tiny_cross_encoder_dir

TEXTS = ["Paris is the capital of France.", "hello", "北京是中国的首都。",
         "def reverse(s): return s[::-1] and a much longer line about the city on the seine"]


@pytest.fixture(scope="module")
def bert_server(tmp_path_factory):
    path = build_tiny_bert_dir(tmp_path_factory.mktemp("tiny-bert"))
    lm = load_model(str(path), device="cpu")
    with ThreadServer(create_app(Settings(model=str(path)), lm=lm)) as server:
        server.model_id = server.state.settings.model_id
        yield server


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = sorted(response.json()["data"], key=lambda d: d["index"])
    return np.array([d["embedding"] for d in data])


def test_embeddings_have_openai_shape_and_usage(bert_server):
    response = post(bert_server, "/v1/embeddings", model=bert_server.model_id, input=TEXTS)
    body = response.json()
    assert body["object"] == "list" and body["model"] == bert_server.model_id
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    assert all(d["object"] == "embedding" and len(d["embedding"]) == 32 for d in body["data"])
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > len(TEXTS) * 2  # [CLS] + [SEP] each
    np.testing.assert_allclose(np.linalg.norm(vectors(response), axis=1), 1.0, rtol=1e-5)


def test_base64_decodes_to_the_float_vectors(bert_server):
    floats = vectors(post(bert_server, "/v1/embeddings", input=TEXTS))
    encoded = post(bert_server, "/v1/embeddings", input=TEXTS, encoding_format="base64").json()["data"]
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in encoded])
    np.testing.assert_array_equal(decoded, floats.astype(np.float32))


def test_a_batch_equals_its_inputs_sent_one_by_one(bert_server):
    batched = vectors(post(bert_server, "/v1/embeddings", input=TEXTS))
    singles = np.concatenate([vectors(post(bert_server, "/v1/embeddings", input=t)) for t in TEXTS])
    np.testing.assert_allclose(batched, singles, atol=1e-6)


def test_token_id_inputs_embed_like_the_text(bert_server):
    tokens = httpx.post(f"{bert_server.url}/v1/embeddings", json={"input": TEXTS[0]}).json()["usage"]
    ids = bert_server.state.lm.encode_text(TEXTS[0])
    assert tokens["prompt_tokens"] == len(ids)
    np.testing.assert_allclose(vectors(post(bert_server, "/v1/embeddings", input=ids)),
                               vectors(post(bert_server, "/v1/embeddings", input=TEXTS[0])), atol=1e-6)
    np.testing.assert_allclose(vectors(post(bert_server, "/v1/embeddings", input=[ids, ids]))[1],
                               vectors(post(bert_server, "/v1/embeddings", input=TEXTS[0]))[0], atol=1e-6)


@pytest.mark.parametrize("body,param,words", [
    ({"input": []}, "input", "empty"),
    ({"input": ""}, "input", "empty string"),
    ({"input": ["ok", ""]}, "input", "input[1]"),
    ({"input": [[]]}, "input", "empty token list"),
    ({"input": [[1, 10**6]]}, "input", "outside the vocabulary"),
    ({"input": "word " * 200}, "input", f"at most {MAX_SEQ_LENGTH}"),
    ({"input": "x", "dimensions": 8}, "dimensions", "not trained for shorter"),
    ({"input": "x", "truncate_prompt_tokens": 10_000}, "truncate_prompt_tokens", "at most"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", ""),
])
def test_bad_inputs_get_a_400_naming_the_field(bert_server, body, param, words):
    response = post(bert_server, "/v1/embeddings", **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param in (error["param"] or "") + error["message"] and words in error["message"]


def test_too_many_inputs_and_too_many_tokens_are_400s(bert_server, monkeypatch):
    monkeypatch.setattr(serving, "MAX_INPUTS", 3)
    response = post(bert_server, "/v1/embeddings", input=TEXTS)
    assert response.status_code == 400 and "at most 3" in response.json()["error"]["message"]
    monkeypatch.setattr(serving, "MAX_INPUTS", 2048)
    monkeypatch.setattr(serving, "MAX_TOTAL_TOKENS", 20)
    response = post(bert_server, "/v1/embeddings", input=TEXTS)
    assert response.status_code == 400 and response.json()["error"]["code"] == "too_many_tokens"


def test_truncation_when_asked_cuts_long_inputs_like_the_tokenizer(bert_server):
    long = "word " * 200
    body = post(bert_server, "/v1/embeddings", input=long, truncate_prompt_tokens=-1).json()
    assert body["usage"]["prompt_tokens"] == MAX_SEQ_LENGTH
    cut = post(bert_server, "/v1/embeddings", input=long, truncate_prompt_tokens=10).json()
    assert cut["usage"]["prompt_tokens"] == 10
    dims = post(bert_server, "/v1/embeddings", input="x", dimensions=32)
    assert dims.status_code == 200, "the native size is always allowed"


def test_rerank_orders_documents_by_cosine_of_their_vectors(bert_server):
    query, docs = TEXTS[0], TEXTS[1:] + ["The capital of France is Paris."]
    all_vectors = vectors(post(bert_server, "/v1/embeddings", input=[query] + docs))
    cosines = all_vectors[1:] @ all_vectors[0]  # unit vectors
    body = post(bert_server, "/v1/rerank", query=query, documents=docs).json()
    assert [r["index"] for r in body["results"]] == list(np.argsort(-cosines))
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], np.sort(cosines)[::-1], atol=1e-5)
    assert body["results"][0]["document"]["text"] == docs[body["results"][0]["index"]]
    top = post(bert_server, "/v1/rerank", query=query, documents=[{"text": d} for d in docs], top_n=2,
               return_documents=False).json()["results"]
    assert [r["index"] for r in top] == [r["index"] for r in body["results"][:2]] and "document" not in top[0]
    empty = post(bert_server, "/v1/rerank", query=query, documents=[])
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "documents"


def test_score_pairs_one_text_with_many_or_lists_pairwise(bert_server):
    v = vectors(post(bert_server, "/v1/embeddings", input=TEXTS))
    one_to_many = post(bert_server, "/v1/score", text_1=TEXTS[0], text_2=TEXTS[1:]).json()
    np.testing.assert_allclose([d["score"] for d in one_to_many["data"]], v[1:] @ v[0], atol=1e-5)
    pairwise = post(bert_server, "/v1/score", text_1=TEXTS[:2], text_2=TEXTS[2:]).json()
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]], [v[0] @ v[2], v[1] @ v[3]], atol=1e-5)
    mismatch = post(bert_server, "/v1/score", text_1=TEXTS[:2], text_2=TEXTS[:3])
    assert mismatch.status_code == 400 and mismatch.json()["error"]["param"] == "text_1"


def test_embedding_model_refuses_chat_and_says_what_it_serves(bert_server):
    response = post(bert_server, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}])
    assert response.status_code == 400 and "/v1/embeddings" in response.json()["error"]["message"]
    model = httpx.get(f"{bert_server.url}/v1/models").json()["data"][0]
    assert model["endpoints"] == ["/v1/embeddings", "/v1/rerank", "/v1/score"] and model["dimensions"] == 32
    assert post(bert_server, "/v1/embeddings", model="other", input="x").status_code == 404


def test_metrics_count_embedding_requests_and_tokens(bert_server):
    before = parse_samples(httpx.get(f"{bert_server.url}/metrics").text)
    tokens = post(bert_server, "/v1/embeddings", input=TEXTS).json()["usage"]["prompt_tokens"]
    post(bert_server, "/v1/rerank", query="q", documents=["a", "b"])
    after = parse_samples(httpx.get(f"{bert_server.url}/metrics").text)
    key = 'simple_serve_embedding_requests_total{endpoint="%s"}'
    assert after[key % "embeddings"] - before.get(key % "embeddings", 0) == 1
    assert after[key % "rerank"] - before.get(key % "rerank", 0) == 1
    assert after["simple_serve_embedding_tokens_total"] - before.get("simple_serve_embedding_tokens_total", 0) \
        == tokens + 3 * 3  # the rerank's query and two documents, [CLS] x [SEP] each
    assert after['simple_serve_requests_total{endpoint="/v1/embeddings",status="200"}'] >= 1


def test_chat_model_asked_for_embeddings_gets_a_400_naming_its_endpoints(make_tiny_server):
    server = make_tiny_server()
    for path, body in [("/v1/embeddings", {"input": "hi"}), ("/v1/rerank", {"query": "q", "documents": ["d"]}),
                       ("/v1/score", {"text_1": "a", "text_2": "b"})]:
        response = httpx.post(f"{server.url}{path}", json=body)
        assert response.status_code == 400, response.text
        assert "chat model" in response.json()["error"]["message"]
        assert "/v1/chat/completions" in response.json()["error"]["message"]
    assert "/v1/chat/completions" in httpx.get(f"{server.url}/v1/models").json()["data"][0]["endpoints"]


@pytest.mark.full  # sentence-transformers' CrossEncoder and a server of its own: 4 s on a Zen 3
def test_cross_encoder_server_reranks_by_its_pair_scores_and_gives_no_embeddings(tmp_path):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    path = build_tiny_cross_encoder_dir(tmp_path / "tiny-reranker")
    query, docs = TEXTS[0], TEXTS[1:] + ["The capital of France is Paris."]
    expected = sentence_transformers.CrossEncoder(str(path), device="cpu").predict([(query, d) for d in docs])
    with ThreadServer(create_app(Settings(model=str(path)), lm=load_model(str(path), device="cpu"))) as server:
        results = post(server, "/v1/rerank", query=query, documents=docs).json()["results"]
        # each document with its own pair score, ranked by it: the tiny model's scores lie within ~1e-5 of each
        # other, so the order of two near-equal ones may differ from sentence-transformers' by rounding (it did in
        # one clean-clone run: two documents 8e-6 apart swapped)
        indices, got = [r["index"] for r in results], [r["relevance_score"] for r in results]
        assert sorted(indices) == list(range(len(docs))) and got == sorted(got, reverse=True)
        np.testing.assert_allclose(got, expected[indices], atol=1e-5)
        scores = post(server, "/v1/score", text_1=query, text_2=docs).json()["data"]
        np.testing.assert_allclose([d["score"] for d in scores], expected, atol=1e-5)
        refused = post(server, "/v1/embeddings", input="x")
        assert refused.status_code == 400 and "cross-encoder" in refused.json()["error"]["message"]
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["endpoints"] == ["/v1/rerank", "/v1/score"]
        chat = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}])
        assert chat.status_code == 400 and "/v1/rerank, /v1/score" in chat.json()["error"]["message"]


def test_matryoshka_model_truncates_to_dimensions_and_renormalises(tmp_path):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    path = build_tiny_bert_dir(tmp_path / "tiny-matryoshka")
    (path / "config_sentence_transformers.json").write_text('{"matryoshka_dims": [32, 16, 8]}')
    expected = sentence_transformers.SentenceTransformer(str(path), device="cpu", truncate_dim=8).encode(
        TEXTS, normalize_embeddings=True)
    with ThreadServer(create_app(Settings(model=str(path)), lm=load_model(str(path), device="cpu"))) as server:
        ours = vectors(post(server, "/v1/embeddings", input=TEXTS, dimensions=8))
        assert ours.shape == (len(TEXTS), 8)
        np.testing.assert_allclose(ours, expected, atol=1e-5)
        too_many = post(server, "/v1/embeddings", input="x", dimensions=33)
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "dimensions"


def test_the_engine_probe_proves_an_embedding_engine_too(bert_server):
    # /health/generate is the liveness probe of the image and the manifests, whichever model is served
    r = httpx.get(bert_server.url + "/health/generate", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    bert_server.state.engine.step_ended_at = bert_server.state.engine.step_started_at = 0.0  # nothing recent
    r = httpx.get(bert_server.url + "/health/generate", timeout=30)
    assert r.status_code == 200 and r.json().get("generated") is True  # proved by one pass now
