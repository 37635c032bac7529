"""LoRA adapters over HTTP on the tiny model: a request's `model` names an adapter and gets its reference tokens;
adapters load and unload at runtime behind the API key, LORA_RUNTIME_LOADING and LORA_ADAPTER_ROOT, each owned by
the key that loaded it; every error is OpenAI-shaped with the status the issue asks for; /v1/models lists the
adapters without their paths, and /metrics their series while they are loaded."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import httpx
import pytest

from app.config import Settings
from app.logs import JsonFormatter
from app.main import create_app
from app.metrics import parse_samples
from conftest import ThreadServer, build_tiny_model
from test_lora import N_TOKENS, PROMPTS, adapters, fresh_lm, reference  # noqa: F401 - `adapters` is a fixture

KEY, OTHER_KEY = "lora-test-key", "lora-other-key"  # two tenants
AUTH, OTHER = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {OTHER_KEY}"}


def root_of(paths: dict[str, str]) -> Path:
    return Path(paths["alpha"]).parent  # the fixture saves every adapter in one directory


def lora_settings(paths: dict[str, str], **extra) -> Settings:
    return Settings(model="tiny", api_key=f"{KEY},{OTHER_KEY}", lora_modules=f"alpha={paths['alpha']}",
                    max_lora_rank=8, lora_runtime_loading=True, lora_adapter_root=root_of(paths), speculative="off",
                    **{"max_loras": 2, **extra})


@pytest.fixture(scope="module")
def server(adapters, tiny_tokenizer):
    with ThreadServer(create_app(lora_settings(adapters[0]), lm=fresh_lm(tiny_tokenizer))) as running:
        yield running


def load(server, name: str, path: str, headers=AUTH, **extra) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, **extra},
                      headers=headers, timeout=60)


def unload(server, name: str, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers, timeout=60)


def complete(server, model: str, prompt: str = PROMPTS[0], headers=AUTH) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": N_TOKENS, "temperature": 0}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)


def text_of(server, tokens: list[int]) -> str:
    return server.state.lm.tokenizer.decode(tokens)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    return error


def test_a_request_naming_an_adapter_gets_the_adapters_tokens_and_the_base_its_own(server, adapters,
                                                                                   tiny_tokenizer):
    _, merged = adapters
    ids = server.state.lm.encode_text(PROMPTS[0])
    for model, oracle in (("alpha", merged["alpha"]), ("tiny", build_tiny_model(len(tiny_tokenizer)))):
        answer = complete(server, model).json()
        assert answer["model"] == model
        assert answer["choices"][0]["text"] == text_of(server, reference(oracle, ids))


def test_the_models_list_shows_each_adapter_with_the_base_as_parent_and_no_path(server, adapters):
    response = httpx.get(f"{server.url}/v1/models", headers=AUTH)
    listed = response.json()["data"]
    assert [m["id"] for m in listed] == ["tiny", "alpha"]
    assert listed[1]["parent"] == "tiny" and "root" not in listed[1]
    assert str(root_of(adapters[0])) not in response.text and "loras" not in response.text


def test_an_unknown_model_is_a_404_naming_it(server):
    error = error_of(complete(server, "gamma"), 404)
    assert "'gamma'" in error["message"] and error["param"] == "model" and error["code"] == "model_not_found"
    chat = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": "gamma", "messages": [{"role": "user", "content": "Hi"}]})
    assert "'gamma'" in error_of(chat, 404)["message"]


def test_an_adapter_loads_serves_and_unloads_at_runtime(server, adapters):
    paths, merged = adapters
    url = server.url
    loaded = load(server, "beta", "beta")  # relative to LORA_ADAPTER_ROOT
    assert loaded.status_code == 200, loaded.text
    answer = complete(server, "beta", PROMPTS[2]).json()
    assert answer["choices"][0]["text"] == text_of(server, reference(merged["beta"],
                                                                     server.state.lm.encode_text(PROMPTS[2])))
    chat = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": "beta", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0})
    assert chat.status_code == 200 and chat.json()["model"] == "beta"
    samples = parse_samples(httpx.get(f"{url}/metrics").text)
    assert samples['simple_serve_lora_requests_total{adapter="beta"}'] == 2
    assert samples['simple_serve_lora_generated_tokens_total{adapter="beta"}'] == N_TOKENS + 3
    gone = unload(server, "beta")
    assert gone.status_code == 200, gone.text
    assert "'beta'" in error_of(complete(server, "beta"), 404)["message"]
    assert "'beta'" in error_of(unload(server, "beta"), 404)["message"]
    assert 'adapter="beta"' not in httpx.get(f"{url}/metrics").text  # its series left with it


@pytest.mark.full
def test_anything_not_loadable_gets_one_message_that_tells_nothing_of_the_disk(server, adapters, tmp_path,
                                                                              monkeypatch):
    """Missing, not a peft adapter, unreadable, outside the root by an absolute path, by `..` or by a symlink: the
    same 400, so a key holder cannot map the server's files through the error messages."""
    paths, _ = adapters
    root = root_of(paths)
    outside = tmp_path / "outside"  # a real adapter, but not under LORA_ADAPTER_ROOT
    shutil.copytree(paths["alpha"], outside)
    (root / "empty-dir").mkdir(exist_ok=True)
    if not (root / "link-out").exists():
        os.symlink(outside, root / "link-out")
    shutil.copytree(paths["alpha"], root / "locked", dirs_exist_ok=True)
    real_read = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied")) if "locked" in str(self) else real_read(self, *a, **k))
    cases = [str(root / "nowhere"), "nowhere", "empty-dir", str(outside), os.path.relpath(outside, root),
             "beta/../../" + outside.parent.name + "/outside", "link-out", "locked", "/etc", "/etc/passwd",
             "/proc/self/environ", "a\0b"]
    messages = set()
    for path in cases:
        error = error_of(load(server, "gamma", path), 400)
        assert error["param"] == "lora_path" and error["code"] == "invalid_lora_adapter"
        assert "LORA_ADAPTER_ROOT" in error["message"]
        messages.add(error["message"].replace(repr(path), "<path>"))
    assert len(messages) == 1, messages
    assert [m["id"] for m in httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]] == ["tiny", "alpha"]
    assert complete(server, "alpha").status_code == 200


def test_a_bad_name_or_a_taken_one_is_a_400_naming_lora_name(server, adapters):
    for name, problem in (("alpha", "load_inplace"), ("tiny", "cannot be named")):
        error = error_of(load(server, name, "beta"), 400)
        assert problem in error["message"] and error["param"] == "lora_name"
    missing = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x"}, headers=AUTH, timeout=60)
    assert missing.status_code in (400, 422) and "lora_path" in missing.text


def test_load_inplace_replaces_the_keys_own_adapter_and_new_requests_get_the_new_weights(server, adapters):
    _, merged = adapters
    ids = server.state.lm.encode_text(PROMPTS[0])
    assert load(server, "swap", "beta").status_code == 200
    try:
        assert complete(server, "swap").json()["choices"][0]["text"] == text_of(server, reference(merged["beta"], ids))
        assert "load_inplace" in error_of(load(server, "swap", "alpha"), 400)["message"]  # vLLM's 400 without it
        replaced = load(server, "swap", "alpha", load_inplace=True)
        assert replaced.status_code == 200, replaced.text
        assert complete(server, "swap").json()["choices"][0]["text"] == text_of(server,
                                                                                reference(merged["alpha"], ids))
        assert [m["id"] for m in httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]] == [
            "tiny", "alpha", "swap"]
    finally:
        unload(server, "swap")


def test_a_tenant_cannot_unload_or_replace_another_tenants_adapter_nor_a_start_up_one(server, adapters):
    assert load(server, "mine", "beta").status_code == 200  # key A's
    try:
        # to key B that name is not loaded (tests/fast/test_lora_tenants.py: nor listed, nor served)
        assert "'mine'" in error_of(unload(server, "mine", OTHER), 404)["message"]
        for headers in (AUTH, OTHER):  # LORA_MODULES' adapters are no tenant's
            for response in (unload(server, "alpha", headers), load(server, "alpha", "beta", headers,
                                                                    load_inplace=True)):
                error = error_of(response, 403)
                assert "LORA_MODULES" in error["message"] and error["param"] == "lora_name"
        assert complete(server, "alpha", headers=OTHER).status_code == 200  # every key may use those
    finally:
        assert unload(server, "mine").status_code == 200  # its owner may
    assert complete(server, "alpha").status_code == 200


@pytest.mark.full
def test_load_use_unload_cycles_under_fresh_names_leave_the_metrics_series_bounded(server):
    def series() -> list[str]:
        return [line for line in httpx.get(f"{server.url}/metrics").text.splitlines()
                if line.startswith("simple_serve_lora_")]

    before = series()
    for i in range(20):
        name = f"cycle-{i}-" + "x" * 200  # client-chosen label values, long ones
        assert load(server, name, "beta").status_code == 200
        used = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60, json={
            "model": name, "prompt": "Hi", "max_tokens": 1})
        assert used.status_code == 200 and used.json()["model"] == name
        assert len(series()) == len(before) + 2
        assert unload(server, name).status_code == 200
    assert [line.split(" ")[0] for line in series()] == [line.split(" ")[0] for line in before]


def test_the_access_log_line_names_the_adapter_served(server, caplog):
    with caplog.at_level(logging.INFO, logger="app.access"):
        assert complete(server, "alpha", headers={**AUTH, "x-request-id": "adapter-log-1"}).status_code == 200
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records if r.name == "app.access"]
    [line] = [line for line in lines if line.get("request_id") == "adapter-log-1"]
    assert line["model"] == "alpha"


@pytest.mark.full
def test_the_trace_span_names_the_adapter_served(adapters, tiny_tokenizer, monkeypatch):
    pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra")
    from test_tracing import Receiver, attributes

    receiver = Receiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: export soon after the request
    try:
        with ThreadServer(create_app(lora_settings(adapters[0]), lm=fresh_lm(tiny_tokenizer))) as running:
            assert complete(running, "alpha").status_code == 200
            [(_, span)] = receiver.wait_for("text_completion alpha")
            assert attributes(span.attributes)["gen_ai.request.model"] == "alpha"
    finally:
        receiver.server.shutdown()


def test_loading_needs_the_api_key(server, adapters):
    body = {"lora_name": "beta", "lora_path": "beta"}
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=60).status_code == 401
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "alpha"}).status_code == 401


def test_runtime_loading_without_a_key_or_a_root_is_refused_at_start_naming_both_settings(adapters):
    paths, _ = adapters
    with pytest.raises(ValueError, match="LORA_RUNTIME_LOADING=true needs API_KEY"):
        Settings(model="tiny", lora_runtime_loading=True, lora_adapter_root=root_of(paths))
    with pytest.raises(ValueError, match="LORA_RUNTIME_LOADING=true needs LORA_ADAPTER_ROOT"):
        Settings(model="tiny", lora_runtime_loading=True, api_key="k")
    with pytest.raises(ValueError, match="LORA_ADAPTER_ROOT applies only with LORA_RUNTIME_LOADING"):
        Settings(model="tiny", lora_adapter_root=root_of(paths))


def test_without_runtime_loading_the_routes_are_404_and_start_up_adapters_still_serve(adapters, tiny_tokenizer):
    paths, _ = adapters
    settings = Settings(model="tiny", lora_modules=f"alpha={paths['alpha']}", speculative="off")
    with ThreadServer(create_app(settings, lm=fresh_lm(tiny_tokenizer))) as running:
        for route, body in (("load", {"lora_name": "beta", "lora_path": paths["beta"]}), ("unload", {"lora_name": "alpha"})):
            response = httpx.post(f"{running.url}/v1/{route}_lora_adapter", json=body, timeout=60)
            assert "LORA_RUNTIME_LOADING" in error_of(response, 404)["message"]
        assert complete(running, "alpha", headers={}).json()["model"] == "alpha"


def test_lora_with_tensor_parallel_is_refused_at_start():
    with pytest.raises(ValueError, match="TENSOR_PARALLEL"):
        Settings(model="tiny", lora_modules="a=/x", tensor_parallel=2)


def test_the_responses_and_messages_apis_select_the_adapter_by_model_too(server):
    responses = httpx.post(f"{server.url}/v1/responses", headers=AUTH, timeout=60, json={
        "model": "alpha", "input": "Hi", "max_output_tokens": 3, "temperature": 0})
    assert responses.status_code == 200, responses.text
    assert responses.json()["model"] == "alpha"
    messages = httpx.post(f"{server.url}/v1/messages", headers=AUTH, timeout=60, json={
        "model": "alpha", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]})
    assert messages.status_code == 200, messages.text
    assert messages.json()["model"] == "alpha"
    assert httpx.post(f"{server.url}/v1/messages", headers=AUTH, timeout=60, json={
        "model": "gamma", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}).status_code == 404
