"""LoRA adapters in a live server process: 8 streams mixing the base and three adapters (two from LORA_MODULES, one
loaded at runtime) decode together, each one's text equal to its solo run, while the runtime one is unloaded under
its running stream (which finishes); no 5xx, and `/health` answers within 100 ms throughout (probed from a process
of its own)."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import serve_process
from test_adversarial import CHAT, HEALTH_BOUND_S, HealthProbe
from test_lora import adapters  # noqa: F401 - the fixture: two peft adapters of the tiny model

pytestmark = [pytest.mark.server, pytest.mark.alone]
MODELS = ["tiny", "alpha", "beta", "tiny", "alpha", "beta", "alpha", "gamma"]  # gamma: loaded at runtime
AUTH = {"Authorization": "Bearer lora-streams-key"}  # runtime loading needs API_KEY


def stream_text(url: str, body: dict) -> str:
    with httpx.stream("POST", url + CHAT, json={"model": "tiny", **body}, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert not any("error" in c for c in chunks), chunks[-1]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)


def unload_midway(url: str, request: dict) -> tuple[str, int]:
    """Stream `request`, unloading its adapter once its first token has come; its text, and the unload's status."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=request, headers=AUTH, timeout=120) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        status = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": request["model"]}, headers=AUTH,
                            timeout=30).status_code
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
    chunks = [json.loads(line[6:]) for line in [first, *rest[:-1]]]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks), status


def body(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Tell me about Paris, {i}."}], "max_tokens": 60,
            "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(tiny_dir, adapters, tmp_path_factory):  # noqa: F811 - `adapters` is the fixture
    paths, _ = adapters
    log = tmp_path_factory.mktemp("lora-streams") / "serve.log"
    env = {"SERVED_MODEL_NAME": "tiny", "LORA_MODULES": f"alpha={paths['alpha']},beta={paths['beta']}",
           "LORA_RUNTIME_LOADING": "true", "LORA_ADAPTER_ROOT": os.path.dirname(paths["alpha"]),
           "API_KEY": AUTH["Authorization"].removeprefix("Bearer "), "MAX_LORA_RANK": "8"}
    with serve_process(tiny_dir, log, env=env) as url:
        yield url, paths


def test_eight_streams_of_base_and_two_adapters_each_equal_their_solo_run(server, tmp_path):
    url, paths = server
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": paths["beta"]},
                        headers=AUTH, timeout=30)
    assert loaded.status_code == 200, loaded.text
    solo = [stream_text(url, {"model": model, **body(i)}) for i, model in enumerate(MODELS)]
    assert solo[0] != solo[1] != solo[2]  # the adapters change the text
    probe = HealthProbe(url, tmp_path)
    time.sleep(1)  # its interpreter has started
    try:
        with ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(stream_text, url, {"model": model, **body(i)}) for i, model in enumerate(MODELS)
                       if model != "gamma"]
            midway = pool.submit(unload_midway, url, {"model": "gamma", **body(7)})  # unloaded under its stream
            together = [f.result() for f in streams]
            text, unloaded = midway.result()
    finally:
        latencies = probe.latencies()
    assert unloaded == 200
    assert together == solo[:7] and text == solo[7]
    assert httpx.post(f"{url}/v1/chat/completions", json={"model": "gamma", **body(7)},
                      headers=AUTH).status_code == 404
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(f"/health with 8 mixed adapter streams: {len(latencies)} probes, p99 {p99 * 1000:.1f} ms")
    assert len(latencies) > 20 and p99 < HEALTH_BOUND_S
    metrics = httpx.get(url + "/metrics").text
    assert not [line for line in metrics.splitlines() if line.startswith("simple_serve_requests_total{")
                and 'status="5' in line and not line.endswith(" 0.0")], metrics
