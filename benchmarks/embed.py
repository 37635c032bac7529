"""`python -m benchmarks embed`: embeddings per second, our server against sentence-transformers' own `encode`.

One run, the same texts, the same model directory: a server process (`python -m app serve --model ...`) driven over
HTTP, and `SentenceTransformer(dir).encode` in this process, in alternating rounds so a neighbour's load on a shared
machine hits both alike. For each batch size B: ours as requests of B inputs each, one at a time; ours as B concurrent
requests of one input each (the engine batches them); and `encode(texts, batch_size=B)`. Prints the median
embeddings/s of the rounds, and the worst cosine between the two sides' vectors as a check that both did the work.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from app.config import Settings
from app.models.fetch import EMBEDDED, fetch_model
from benchmarks.processes import free_port

SENTENCES = [
    "The capital of France is Paris, a city on the Seine.", "我喜欢在周末去公园散步。",
    "Vector search finds the nearest neighbours of a query embedding.", "机器学习模型需要大量的数据。",
    "How do I reset the password of my account?", "Rerankers sort retrieved documents by relevance to the query.",
    "今天的天气非常好，适合出去玩。", "Transformers relate every token to every other with self-attention.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="all-minilm-l6-v2", help="embedded name or local sentence-transformers dir")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--texts", type=int, default=64, help="texts embedded per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the figures as JSON here")


def start_server(model: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k.upper() not in {n.upper() for n in Settings.model_fields}}
    env["MAX_PREPARING"] = "64"  # 32 concurrent requests would pass the default 16 being parsed at once (429s)
    proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--model", model, "--log-level", "warning"], env=env,
                            cwd=Path(__file__).resolve().parents[1])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server not ready after 300 s")


def ours_batched(client: httpx.Client, url: str, texts: list[str], batch: int) -> np.ndarray:
    out = []
    for i in range(0, len(texts), batch):
        response = client.post(f"{url}/v1/embeddings", json={"input": texts[i:i + batch]}, timeout=300)
        response.raise_for_status()
        out += [d["embedding"] for d in response.json()["data"]]
    return np.array(out)


def ours_concurrent(client: httpx.Client, url: str, texts: list[str], batch: int) -> np.ndarray:
    def one(text: str) -> list[float]:
        response = client.post(f"{url}/v1/embeddings", json={"input": text}, timeout=300)
        response.raise_for_status()
        return response.json()["data"][0]["embedding"]

    with ThreadPoolExecutor(batch) as pool:
        return np.array(list(pool.map(one, texts)))


def timed(fn) -> tuple[float, np.ndarray]:
    started = time.perf_counter()
    vectors = fn()
    return time.perf_counter() - started, vectors


def worst_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def run(args: argparse.Namespace) -> dict:
    from sentence_transformers import SentenceTransformer

    directory = fetch_model(args.model, Settings().model_cache) if args.model in EMBEDDED else Path(args.model)
    texts = [SENTENCES[i % len(SENTENCES)] + f" ({i})" for i in range(args.texts)]  # no two alike
    reference = SentenceTransformer(str(directory), device="cpu")
    reference.encode(texts[:4])  # warm-up
    proc, url = start_server(args.model)
    results, worst = {}, 1.0
    try:
        with httpx.Client(limits=httpx.Limits(max_connections=64)) as client:
            ours_batched(client, url, texts[:4], 4)  # warm-up
            for batch in (int(b) for b in args.batches.split(",")):
                seconds: dict[str, list[float]] = {"ours, B inputs per request": [],
                                                   "ours, B concurrent requests of 1": [],
                                                   "sentence-transformers encode": []}
                for _ in range(args.rounds):
                    t, ours = timed(lambda: ours_batched(client, url, texts, batch))
                    seconds["ours, B inputs per request"].append(t)
                    t, concurrent = timed(lambda: ours_concurrent(client, url, texts, batch))
                    seconds["ours, B concurrent requests of 1"].append(t)
                    t, theirs = timed(lambda: reference.encode(texts, batch_size=batch))
                    seconds["sentence-transformers encode"].append(t)
                    worst = min(worst, worst_cosine(ours, theirs), worst_cosine(concurrent, theirs))
                results[batch] = {name: len(texts) / statistics.median(ts) for name, ts in seconds.items()}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    report = {"model": args.model, "texts": len(texts), "rounds": args.rounds, "cpu": platform.processor() or
              platform.machine(), "cores": os.cpu_count(), "embeddings_per_s": results, "worst_cosine": worst}
    print(f"{args.model}: {len(texts)} texts, median of {args.rounds} rounds, {os.cpu_count()} cores")
    print(f"{'batch':>5}  " + "  ".join(f"{name:>34}" for name in next(iter(results.values()))))
    for batch, figures in results.items():
        print(f"{batch:>5}  " + "  ".join(f"{v:>28.1f} emb/s" for v in figures.values()))
    print(f"worst cosine, ours against sentence-transformers: {worst:.6f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report
