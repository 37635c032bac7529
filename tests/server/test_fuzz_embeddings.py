"""Fuzz the embedding endpoints with schemathesis from the server's own /openapi.json, against a tiny random BERT
and a tiny cross-encoder (tests/embedding_models.py): valid and invalid bodies for /v1/embeddings, /v1/rerank and
/v1/score never get a 5xx, and every 4xx is OpenAI's error JSON (the checks are tests/server/test_fuzz.py's)."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from app.config import Settings
from app.main import create_app
from app.models.loading import load_model
from conftest import ThreadServer
from embedding_models import build_tiny_bert_dir, build_tiny_cross_encoder_dir
from test_fuzz import DERANDOMIZE, check_response

pytestmark = pytest.mark.server
EXAMPLES = {"POST /v1/embeddings": 300, "POST /v1/rerank": 160, "POST /v1/score": 160}


@pytest.fixture(scope="module", params=["bi-encoder", "cross-encoder"])
def embedding_server(request, tmp_path_factory):
    build = build_tiny_bert_dir if request.param == "bi-encoder" else build_tiny_cross_encoder_dir
    path = build(tmp_path_factory.mktemp(f"fuzz-{request.param}"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model gains nothing from two threads on a shared CPU
    try:
        with ThreadServer(create_app(Settings(model=str(path)), lm=load_model(str(path), device="cpu"))) as server:
            yield server
    finally:
        torch.set_num_threads(threads)


def test_fuzz_embedding_operations(embedding_server):
    schema = schemathesis.openapi.from_url(embedding_server.url + "/openapi.json")
    operations = {result.ok().label: result.ok() for result in schema.get_all_operations()}
    assert set(operations) >= set(EXAMPLES)
    statuses: Counter[str] = Counter()
    started = time.perf_counter()
    for label, total in EXAMPLES.items():
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=operations[label].as_strategy(generation_mode=mode))
            @settings(max_examples=total // 2, deadline=None, database=None, derandomize=DERANDOMIZE,
                      print_blob=True, suppress_health_check=list(HealthCheck))
            def run(case):
                response = case.call(base_url=embedding_server.url, timeout=60)
                statuses[f"{label} {mode.value} {response.status_code}"] += 1
                check_response(response, f"{label} {mode.value}: {case.body!r:.300}")

            run()
    print(f"\nfuzz: {sum(statuses.values())} requests in {time.perf_counter() - started:.0f} s: "
          f"{dict(sorted(statuses.items()))}")
    assert any(key.endswith(" 200") for key in statuses), "some generated requests were served"
    assert embedding_server.state.engine.in_flight == 0
