"""Pooling models without a server: vectors equal sentence-transformers' encode for every pooling mode, padding and
batching change no vector, a decoder embedder's vector is its own last hidden state, a cross-encoder's scores equal
sentence-transformers' CrossEncoder.predict, and the embedding engine batches concurrent requests into one pass."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from app.errors import ConfigError
from app.core.engine.embedding import EmbeddingEngine
from app.models.loading import load_model, serves_embeddings
from app.models.pooling import PoolingModel

from embedding_models import build_tiny_bert_dir, build_tiny_cross_encoder_dir, decoder_embedder_dir

TEXTS = ["Paris is the capital of France.", "hello", "北京是中国的首都。",
         "def reverse(s): return s[::-1] and a much longer line of text about the city on the seine river"]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return build_tiny_bert_dir(tmp_path_factory.mktemp("tiny-bert"))


@pytest.mark.parametrize("pooling,normalize", [("mean", True), ("cls", False), ("max", True),
                                               ("mean_sqrt_len", False), ("lasttoken", True)])
def test_vectors_equal_sentence_transformers_encode(tmp_path, pooling, normalize):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    path = build_tiny_bert_dir(tmp_path, pooling=pooling, normalize=normalize)
    ours = load_model(str(path), device="cpu")
    assert isinstance(ours, PoolingModel) and ours.config.pooling == pooling
    reference = sentence_transformers.SentenceTransformer(str(path), device="cpu").encode(
        TEXTS, convert_to_tensor=True)
    vectors = ours.embed([ours.encode_text(t) for t in TEXTS])
    torch.testing.assert_close(vectors, reference, atol=1e-5, rtol=1e-4)


def test_a_batch_gives_each_row_the_vector_it_gets_alone(bert_dir):
    lm = load_model(str(bert_dir), device="cpu")
    rows = [lm.encode_text(t) for t in TEXTS]
    assert len({len(r) for r in rows}) > 1, "rows of different lengths, so the batch is padded"
    batched = lm.embed(rows)
    alone = torch.cat([lm.embed([r]) for r in rows])
    torch.testing.assert_close(batched, alone, atol=1e-6, rtol=1e-5)
    assert torch.allclose(batched.norm(dim=1), torch.ones(len(rows)))  # Normalize is in modules.json


def test_bare_encoder_directory_gets_mean_pooling_without_normalisation(tmp_path):
    path = build_tiny_bert_dir(tmp_path, sentence_transformers=False)
    lm = load_model(str(path), device="cpu")
    assert (lm.config.pooling, lm.config.normalize) == ("mean", False)
    ids = lm.encode_text(TEXTS[0])
    hidden = lm.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    torch.testing.assert_close(lm.embed([ids])[0], hidden.mean(dim=0))


def test_decoder_embedder_pools_its_own_last_hidden_state(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    path = decoder_embedder_dir(tiny_dir, tmp_path / "decoder-embedder")
    assert serves_embeddings(str(path)) and not serves_embeddings(str(tiny_dir))
    lm = load_model(str(path), device="cpu")
    assert lm.config.pooling == "lasttoken" and lm.kind == "embedding"
    causal = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = [lm.encode_text(t) for t in TEXTS]
    expected = []
    for row in rows:
        states = causal(torch.tensor([row]), output_hidden_states=True).hidden_states[-1]  # [1, T, H]
        expected.append(torch.nn.functional.normalize(states[0, -1], dim=0))
    # right padding: the last real token of a short row never attends to the padding after it
    torch.testing.assert_close(lm.embed(rows), torch.stack(expected).detach(), atol=1e-5, rtol=1e-4)


def test_cross_encoder_scores_equal_sentence_transformers_predict(tmp_path):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    path = build_tiny_cross_encoder_dir(tmp_path)
    lm = load_model(str(path), device="cpu")
    assert lm.scores_pairs and serves_embeddings(str(path))
    pairs = [(TEXTS[0], t) for t in TEXTS[1:]] + [(TEXTS[2], TEXTS[3])]
    reference = sentence_transformers.CrossEncoder(str(path), device="cpu").predict(pairs)
    rows = [lm.encode_pair(a, b) for a, b in pairs]
    assert rows[0].token_type_ids is not None and 1 in rows[0].token_type_ids, "the second text has its own type"
    scores = lm.embed(rows)[:, 0]
    torch.testing.assert_close(scores, torch.tensor(reference, dtype=torch.float32), atol=1e-5, rtol=1e-4)
    alone = torch.cat([lm.embed([row])[:, 0] for row in rows])
    torch.testing.assert_close(scores, alone, atol=1e-6, rtol=1e-5)


def test_cross_encoder_with_several_labels_is_refused_with_a_reason(tmp_path):
    path = build_tiny_cross_encoder_dir(tmp_path, num_labels=3)
    with pytest.raises(ConfigError, match="3 labels"):
        load_model(str(path), device="cpu")


def test_concurrent_requests_share_one_pass_and_get_their_own_vectors(bert_dir):
    lm = load_model(str(bert_dir), device="cpu")

    async def run(tokens_per_batch: int):
        release = threading.Event()

        def slow_load():
            release.wait(10)  # requests queue up while the model "loads"
            return lm

        engine = EmbeddingEngine(slow_load, tokens_per_batch=tokens_per_batch)
        engine.start()
        requests = [[lm.encode_text(t)] for t in TEXTS[:3]] + [[lm.encode_text(t) for t in TEXTS]]
        pending = [asyncio.ensure_future(engine.embed(rows)) for rows in requests]
        await asyncio.sleep(0.05)
        release.set()
        results = await asyncio.gather(*pending)
        engine.stop()
        return requests, results, engine.passes

    requests, results, passes = asyncio.run(run(tokens_per_batch=10_000))
    assert passes == 1, "seven rows of four requests fit the budget: one pass"
    for rows, vectors in zip(requests, results):
        torch.testing.assert_close(torch.stack(vectors), lm.embed(rows), atol=1e-6, rtol=1e-5)
    longest = max(len(lm.encode_text(t)) for t in TEXTS)
    _, results_small, passes_small = asyncio.run(run(tokens_per_batch=longest))
    # the longest row fills a pass alone; shorter ones share passes within the budget
    assert 1 < passes_small < 7, "a budget of one longest row: the seven rows split over several passes"
    for a, b in zip(results, results_small):
        torch.testing.assert_close(torch.stack(a), torch.stack(b), atol=1e-6, rtol=1e-5)
