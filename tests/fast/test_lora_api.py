"""LoRA adapters over HTTP on the tiny model: a request's `model` names an adapter and gets its reference tokens;
adapters load and unload at runtime behind the API key and LORA_RUNTIME_LOADING; every error is OpenAI-shaped with
the status the issue asks for; /v1/models and /metrics show the adapters."""

from __future__ import annotations

import httpx
import pytest

from app.config import Settings
from app.main import create_app
from app.metrics import parse_samples
from conftest import ThreadServer, build_tiny_model
from test_lora import N_TOKENS, PROMPTS, adapters, fresh_lm, reference  # noqa: F401 - `adapters` is a fixture

KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(adapters, tiny_tokenizer):
    paths, _ = adapters
    settings = Settings(model="tiny", api_key=KEY, lora_modules=f"alpha={paths['alpha']}", max_loras=2,
                        max_lora_rank=8, lora_runtime_loading=True, speculative="off")
    with ThreadServer(create_app(settings, lm=fresh_lm(tiny_tokenizer))) as running:
        yield running


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


def test_the_models_list_shows_each_adapter_with_the_base_as_parent(server, adapters):
    listed = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]
    assert [m["id"] for m in listed] == ["tiny", "alpha"]
    assert listed[1]["parent"] == "tiny" and listed[1]["root"] == adapters[0]["alpha"]


def test_an_unknown_model_is_a_404_naming_it(server):
    error = error_of(complete(server, "gamma"), 404)
    assert "'gamma'" in error["message"] and error["param"] == "model" and error["code"] == "model_not_found"
    chat = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": "gamma", "messages": [{"role": "user", "content": "Hi"}]})
    assert "'gamma'" in error_of(chat, 404)["message"]


def test_an_adapter_loads_serves_and_unloads_at_runtime(server, adapters):
    paths, merged = adapters
    url = server.url
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": paths["beta"]},
                        headers=AUTH, timeout=60)
    assert loaded.status_code == 200, loaded.text
    answer = complete(server, "beta", PROMPTS[2]).json()
    assert answer["choices"][0]["text"] == text_of(server, reference(merged["beta"],
                                                                     server.state.lm.encode_text(PROMPTS[2])))
    chat = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": "beta", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0})
    assert chat.status_code == 200 and chat.json()["model"] == "beta"
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "beta"}, headers=AUTH, timeout=60)
    assert gone.status_code == 200, gone.text
    assert "'beta'" in error_of(complete(server, "beta"), 404)["message"]
    again = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "beta"}, headers=AUTH, timeout=60)
    assert "'beta'" in error_of(again, 404)["message"]
    samples = parse_samples(httpx.get(f"{url}/metrics").text)
    assert samples['simple_serve_lora_requests_total{adapter="beta"}'] == 2
    assert samples['simple_serve_lora_generated_tokens_total{adapter="beta"}'] == N_TOKENS + 3


def test_a_bad_load_is_a_400_naming_the_problem_and_loaded_adapters_keep_serving(server, adapters, tmp_path):
    paths, _ = adapters
    cases = [({"lora_name": "x", "lora_path": str(tmp_path / "nowhere")}, "does not exist", "lora_path"),
             ({"lora_name": "x", "lora_path": str(tmp_path)}, "not a peft adapter", "lora_path"),
             ({"lora_name": "alpha", "lora_path": paths["alpha"]}, "already loaded", "lora_name"),
             ({"lora_name": "tiny", "lora_path": paths["alpha"]}, "cannot be named", "lora_name")]
    for body, problem, param in cases:
        response = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=AUTH, timeout=60)
        error = error_of(response, 400)
        assert problem in error["message"] and error["param"] == param
    missing = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x"}, headers=AUTH, timeout=60)
    assert missing.status_code in (400, 422) and "lora_path" in missing.text
    assert complete(server, "alpha").status_code == 200


def test_loading_needs_the_api_key(server, adapters):
    body = {"lora_name": "beta", "lora_path": adapters[0]["beta"]}
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=60).status_code == 401
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "alpha"}).status_code == 401


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
