"""The real embedding model (`MODEL=all-minilm-l6-v2`, fetched by `make setup`) in a real server process: its
vectors equal sentence-transformers' own `encode` of the same directory, singly and batched, float and base64;
/v1/rerank orders documents as sentence-transformers' vectors do; and the clients apps use for retrieval (the
`openai` SDK, LangChain's OpenAIEmbeddings, LlamaIndex's OpenAILikeEmbedding) work against it unchanged."""

from __future__ import annotations

import base64
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from app.models.fetch import fetch_model

from conftest import MODEL_CACHE
from test_server_real import ServerProcess, clean_env

pytestmark = [pytest.mark.real_model, pytest.mark.server]

MODEL = "all-minilm-l6-v2"
MIN_COSINE = 0.9999
# 50 texts of mixed lengths, English and Chinese (and a few mixed), from one word to a few hundred tokens.
TEXTS = [
    "hello", "Paris", "北京", "你好", "embedding",
    "The cat sat on the mat.", "我喜欢喝咖啡。", "How do I reset my password?", "今天天气怎么样？",
    "Vector search finds the nearest neighbours of a query.",
    "机器学习是人工智能的一个分支。", "The quick brown fox jumps over the lazy dog.",
    "Python 是一种流行的编程语言。", "What is the capital of France?", "上海是中国最大的城市之一。",
    "Rerankers score each document against the query and sort them.",
    "请把这段话翻译成英文。", "A good night's sleep improves memory and mood.", "长城是世界上最长的建筑。",
    "Retrieval-augmented generation combines search with a language model.",
    "我们明天早上九点在火车站见面，别迟到。", "Water boils at one hundred degrees Celsius at sea level.",
    "熊猫主要生活在中国的四川省，以竹子为食。", "The stock market closed higher today after a volatile session.",
    "深度学习模型需要大量的数据和计算资源来训练。",
    "She opened the window, and the cold morning air filled the small kitchen.",
    "这家餐厅的菜很好吃，但是服务有点慢。", "Transformers use self-attention to relate every token to every other.",
    "春天来了，公园里的花都开了，很多人来拍照。", "Mixed 中英文 text: the model reads both 语言 at once.",
    "The committee will review the proposal next week and publish its findings in the spring.",
    "在这个快速变化的时代，终身学习变得越来越重要，每个人都需要不断更新自己的知识。",
    "Photosynthesis converts light energy into chemical energy stored in glucose molecules.",
    "他一边听音乐，一边写作业，结果作业写错了很多。", "Can you recommend a quiet hotel near the old town with parking?",
    "人工智能正在改变医疗、金融、教育和交通等许多行业。",
    "The library extended its opening hours during the exam period to help students prepare.",
    "如果明天下雨，我们就把野餐改到下个星期六。", "GPUs accelerate matrix multiplication, the core of neural network training.",
    "中国的四大发明是造纸术、印刷术、火药和指南针。",
    " ".join(["The history of the city goes back two thousand years, to a small fishing village on the river."] * 3),
    "。".join(["这座城市的历史可以追溯到两千年前，当时它只是河边的一个小渔村"] * 3),
    " ".join(["Embedding models map text to vectors so that similar meanings land close together."] * 4),
    "A single very long sentence that keeps going with clause after clause, describing the journey of a traveller "
    "who crossed mountains, rivers and deserts, met merchants and monks, learned new languages, and finally came "
    "home many years later to tell the story to anyone who would listen in the village square.",
    "，".join(["旅行者翻过高山，渡过河流，穿过沙漠，遇见了商人和僧侣"] * 4) + "。",
    "Short. " * 20, "数据" * 30, "The end.", "结束。", "?",
]
RERANK_QUERY = "Which city is the capital of France?"
RERANK_DOCS = ["Paris is the capital and largest city of France.", "Berlin is the capital of Germany.",
               "法国的首都是巴黎。", "The Eiffel Tower is in Paris.", "Bananas are rich in potassium.",
               "France is a country in Western Europe.", "Tokyo is the capital of Japan."]


@pytest.fixture(scope="module")
def directory():
    return fetch_model(MODEL, MODEL_CACHE)


@pytest.fixture(scope="module")
def reference(directory):
    """sentence-transformers' own model over the same directory: the oracle."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(directory), device="cpu")


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, directory):
    failed_before = request.session.testsfailed
    log_path = tmp_path_factory.mktemp("embeddings") / "server.log"
    srv = ServerProcess(log_path, clean_env(), port=None)
    srv.argv = [sys.executable, "-m", "app", "serve", "--host", "127.0.0.1", "--port", str(srv.port),
                "--model", MODEL]
    srv.start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
        if request.session.testsfailed > failed_before:
            print("\n" + srv.log_tail(), file=sys.stderr)


def cosines(ours: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    ours, theirs = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    return (ours * theirs).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))


def embed(server, inputs, encoding_format: str = "float") -> np.ndarray:
    response = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, "input": inputs,
                                                                "encoding_format": encoding_format}, timeout=120)
    assert response.status_code == 200, response.text
    data = sorted(response.json()["data"], key=lambda d: d["index"])
    if encoding_format == "base64":
        return np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data])
    return np.array([d["embedding"] for d in data])


def assert_matches(ours, expected) -> None:
    found = cosines(ours, expected)
    worst = int(found.argmin())
    assert found.min() >= MIN_COSINE, f"text {worst} ({TEXTS[worst][:40]!r}) has cosine {found[worst]:.6f}"


def test_texts_are_mixed_lengths_in_english_and_chinese(reference):
    lengths = [len(reference.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert len(TEXTS) == 50 and min(lengths) <= 3 and max(lengths) >= 100
    assert sum(any("\u4e00" <= c <= "\u9fff" for c in t) for t in TEXTS) >= 20


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_batched_vectors_equal_sentence_transformers(server, reference, encoding_format):
    assert_matches(embed(server, TEXTS, encoding_format), reference.encode(TEXTS))


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_single_vectors_equal_sentence_transformers(server, reference, encoding_format):
    ours = np.concatenate([embed(server, text, encoding_format) for text in TEXTS])
    assert_matches(ours, reference.encode(TEXTS))


def test_concurrent_requests_batched_together_keep_their_own_vectors(server, reference):
    with ThreadPoolExecutor(8) as pool:
        ours = np.concatenate(list(pool.map(lambda t: embed(server, [t]), TEXTS)))
    assert_matches(ours, reference.encode(TEXTS))


def test_rerank_orders_documents_as_sentence_transformers_cosine_does(server, reference):
    response = httpx.post(f"{server.url}/v1/rerank", json={"model": MODEL, "query": RERANK_QUERY,
                                                            "documents": RERANK_DOCS}, timeout=60)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    query, docs = reference.encode([RERANK_QUERY]), reference.encode(RERANK_DOCS)
    expected = cosines(np.repeat(query, len(RERANK_DOCS), axis=0), docs)
    assert [r["index"] for r in results] == list(np.argsort(-expected))
    np.testing.assert_allclose([r["relevance_score"] for r in results], np.sort(expected)[::-1], atol=1e-4)
    assert RERANK_DOCS[results[0]["index"]].startswith("Paris")


def test_openai_sdk_embeddings_create(server, reference):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    result = client.embeddings.create(model=MODEL, input=TEXTS[:10])  # the SDK asks for base64 and decodes it
    assert result.usage.prompt_tokens > 10
    assert_matches(np.array([d.embedding for d in result.data]), reference.encode(TEXTS[:10]))
    floats = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert_matches(np.array([floats.data[0].embedding]), reference.encode(TEXTS[:1]))


def test_langchain_openai_embeddings(server, reference):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: else LangChain tokenizes with tiktoken and sends OpenAI's token ids
    embeddings = OpenAIEmbeddings(model=MODEL, base_url=f"{server.url}/v1", api_key="unused",
                                  check_embedding_ctx_length=False)
    assert_matches(np.array(embeddings.embed_documents(TEXTS[:12])), reference.encode(TEXTS[:12]))
    assert_matches(np.array([embeddings.embed_query(TEXTS[0])]), reference.encode(TEXTS[:1]))


def test_llamaindex_openai_like_embedding(server, reference):
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding

    embedding = OpenAILikeEmbedding(model_name=MODEL, api_base=f"{server.url}/v1", api_key="unused")
    assert_matches(np.array(embedding.get_text_embedding_batch(TEXTS[:15])), reference.encode(TEXTS[:15]))
    assert_matches(np.array([embedding.get_query_embedding(TEXTS[0])]), reference.encode(TEXTS[:1]))


def test_dockerfile_command_serves_the_embedding_model(tmp_path_factory, directory):
    """The image's own command and ENV, run outside Docker with `-e MODEL=all-minilm-l6-v2`: the probes the
    Dockerfile and docker/k8s/deployment.yaml use (/health, /ready) pass, and the SDK gets embeddings."""
    import signal

    from openai import OpenAI

    from conftest import free_port
    from test_server_real import ROOT, host_command, parse_dockerfile

    entrypoint, cmd, image_env = parse_dockerfile((ROOT / "Dockerfile").read_text())
    port = free_port()
    env = clean_env()
    env.update(image_env)
    env.update(MODEL=MODEL, HOST="127.0.0.1", PORT=str(port), DEVICE="cpu", MODEL_CACHE=str(MODEL_CACHE),
               HF_HOME=str(tmp_path_factory.mktemp("hf")), PYTHONPATH=str(ROOT))  # this checkout as the image's app
    workdir = tmp_path_factory.mktemp("docker-workdir")
    srv = ServerProcess(workdir / "server.log", env, argv=host_command(entrypoint, cmd), port=port, cwd=workdir)
    srv.start()
    ok = False
    try:
        srv.wait_ready()
        assert httpx.get(f"{srv.url}/health").status_code == 200
        sdk = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in sdk.models.list().data] == [MODEL]
        assert len(sdk.embeddings.create(model=MODEL, input="hello").data[0].embedding) == 384
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=30) == 0
        ok = True
    finally:
        srv.stop()
        if not ok:
            print("\n" + srv.log_tail(), file=sys.stderr)
