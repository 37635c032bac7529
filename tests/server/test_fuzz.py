"""Fuzz the HTTP API with schemathesis, from the server's own /openapi.json: every operation, positive cases (valid
by the schema) and negative ones (not), over a real socket against the tiny model.

What must hold for every request: no 5xx; every 4xx is OpenAI's error JSON (Anthropic's on /v1/messages*); every 200
stream is well-formed SSE that ends with `[DONE]` (with `message_stop` on /v1/messages). The context window and the default max_tokens are small, so a generated request costs little
and the whole run takes a minute or two. Runs are derandomized: the same cases each time, so a failure reproduces.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import Counter

import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig

from app.config import Settings
from app.main import create_app
from conftest import ThreadServer

pytestmark = pytest.mark.server
# examples per operation and mode; operations without inputs (GET /health) have one case, whatever is asked
EXAMPLES = {"POST /v1/chat/completions": 450, "POST /v1/completions": 270, "POST /tokenize": 180,
            "POST /detokenize": 120, "POST /v1/messages": 300, "POST /v1/messages/count_tokens": 120}
NEGATIVE_SHARE = 0.5
MIN_REQUESTS = 1000
DERANDOMIZE = os.environ.get("FUZZ_RANDOM") is None  # FUZZ_RANDOM=1: new cases each run, to hunt for more


def header(response, name: str) -> str:
    """schemathesis keeps every value of a header, under its name as sent."""
    values = {k.lower(): v for k, v in response.headers.items()}.get(name, [""])
    return values[0] if isinstance(values, list) else values


def check_response(response, label: str) -> None:
    status = response.status_code
    assert status < 500, f"{label}: {status} {response.text[:500]}"
    if label.startswith("POST /v1/messages"):
        return check_anthropic_response(response, label)
    if status >= 400:
        body = response.json()
        assert list(body) == ["error"], f"{label}: {status} {body}"
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, f"{label}: {error}"
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error
        assert error["param"] is None or isinstance(error["param"], str), error
    elif header(response, "content-type").startswith("text/event-stream"):
        data = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
        assert data and data[-1] == "[DONE]", f"{label}: stream ended without [DONE]: {response.text[-300:]}"
        for payload in data[:-1]:
            chunk = json.loads(payload)
            assert "error" not in chunk, f"{label}: mid-stream error {chunk}"


def check_anthropic_response(response, label: str) -> None:
    status = response.status_code
    if status >= 400:
        body = response.json()
        assert set(body) == {"type", "error"} and body["type"] == "error", f"{label}: {status} {body}"
        assert set(body["error"]) == {"type", "message"} and body["error"]["message"], f"{label}: {body}"
    elif header(response, "content-type").startswith("text/event-stream"):
        kinds = [json.loads(line[len("data: "):])["type"] for line in response.text.splitlines()
                 if line.startswith("data: ")]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop", f"{label}: {kinds}"
        assert "error" not in kinds, f"{label}: mid-stream error {response.text[-300:]}"


@pytest.fixture(scope="module")
def fuzzed_server(tiny_lm):
    # 64 tokens of context and 4 default new tokens: every generated request is cheap, even with n=8
    lm = dataclasses.replace(tiny_lm, max_context=64)
    # One torch thread: the tiny model gains nothing from two, and on a busy shared CPU two spinning OpenMP threads
    # made each step 10-30x slower (an n=6 stream of 4 tokens took 10 s instead of 0.1 s here).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadServer(create_app(Settings(model="tiny", default_max_tokens=4), lm=lm)) as server:
            yield server
    finally:
        torch.set_num_threads(threads)


def test_fuzz_every_operation(fuzzed_server):
    # schemathesis stops reading a stream after 20 events by default; we check every stream to its end
    config = SchemathesisConfig.from_dict({"max-stream-events": 10_000})
    schema = schemathesis.openapi.from_url(fuzzed_server.url + "/openapi.json", config=config)
    sent: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    started = time.perf_counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= set(EXAMPLES) | {"GET /health", "GET /ready", "GET /metrics",
                                                              "GET /v1/models"}
    for operation in operations:
        has_body = operation.label in EXAMPLES  # only bodies can be made invalid: GETs have no inputs at all
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_body else (GenerationMode.POSITIVE,):
            total = EXAMPLES.get(operation.label, 1)
            examples = max(1, round(total * (NEGATIVE_SHARE if mode is GenerationMode.NEGATIVE else
                                             1 - NEGATIVE_SHARE)))

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, database=None, derandomize=DERANDOMIZE, print_blob=True,
                      suppress_health_check=list(HealthCheck))
            def run(case):
                response = case.call(base_url=fuzzed_server.url, timeout=60)
                sent[operation.label] += 1
                statuses[f"{operation.label} {mode.value} {response.status_code}"] += 1
                check_response(response, f"{operation.label} {mode.value}: {case.body!r:.300}")

            run()
    seconds = time.perf_counter() - started
    print(f"\nfuzz: {sum(sent.values())} requests in {seconds:.0f} s: {dict(sorted(statuses.items()))}")
    assert sum(sent.values()) >= MIN_REQUESTS, sent
    assert set(sent) >= set(EXAMPLES), sent
    state = fuzzed_server.state
    deadline = time.monotonic() + 30
    while state.engine.in_flight and time.monotonic() < deadline:
        time.sleep(0.1)
    assert state.engine.in_flight == 0, "every generation finished or was cancelled"
