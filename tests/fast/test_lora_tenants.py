"""LoRA adapters per API key (issue 58, item 10): a runtime adapter's name is its key's alone, so another key that
names it gets the 404 any unknown model gets, does not see it in /v1/models, and may load its own adapter under
that name; and one key holds at most MAX_LORAS_PER_KEY of the runtime slots, so it cannot take them all. The
start-up adapters (LORA_MODULES) stay every key's."""

from __future__ import annotations

import httpx
import pytest

from app.config import Settings
from app.main import create_app
from app.metrics import parse_samples
from conftest import ThreadServer
from test_lora import PROMPTS, adapters, fresh_lm, reference  # noqa: F401 - `adapters` is a fixture
from test_lora_api import AUTH, KEY, OTHER, OTHER_KEY, complete, error_of, load, lora_settings, text_of, unload

# the start-up adapter `alpha` and four runtime slots; with two keys each key may hold two of them (the default)
MAX_LORAS = 5


@pytest.fixture(scope="module")
def server(adapters, tiny_tokenizer):
    with ThreadServer(create_app(lora_settings(adapters[0], max_loras=MAX_LORAS),
                                 lm=fresh_lm(tiny_tokenizer))) as running:
        yield running


def models(server, headers) -> list[str]:
    return [m["id"] for m in httpx.get(f"{server.url}/v1/models", headers=headers).json()["data"]]


def test_another_keys_adapter_is_an_unknown_model_on_every_route_and_not_listed(server):
    assert load(server, "mine", "beta").status_code == 200  # key A's
    try:
        assert complete(server, "mine").status_code == 200
        assert models(server, AUTH) == ["tiny", "alpha", "mine"]
        assert models(server, OTHER) == ["tiny", "alpha"]
        hi = [{"role": "user", "content": "Hi"}]
        for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
                           ("/v1/chat/completions", {"messages": hi, "max_tokens": 1}),
                           ("/v1/responses", {"input": "Hi", "max_output_tokens": 1}),
                           ("/v1/messages", {"messages": hi, "max_tokens": 1}),
                           ("/v1/messages/count_tokens", {"messages": hi}),
                           ("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})):
            response = httpx.post(f"{server.url}{path}", headers=OTHER, timeout=60, json={"model": "mine", **body})
            assert response.status_code == 404, (path, response.text)
            assert "'mine'" in response.text and "'alpha'" in response.text  # it names what this key may use
            assert response.text.count("mine") == 1, (path, response.text)  # once: the name it was sent
        assert "'mine'" in error_of(unload(server, "mine", OTHER), 404)["message"]
        assert complete(server, "mine").status_code == 200  # still key A's, untouched
    finally:
        assert unload(server, "mine").status_code == 200


def test_two_keys_may_load_one_name_and_each_runs_its_own_adapter(server, adapters):
    _, merged = adapters
    ids = server.state.lm.encode_text(PROMPTS[1])
    assert load(server, "shared", "beta").status_code == 200  # key A's `shared`: beta's weights
    try:
        assert load(server, "shared", "alpha", OTHER).status_code == 200  # key B's: alpha's
        for headers, oracle in ((AUTH, merged["beta"]), (OTHER, merged["alpha"])):
            answer = complete(server, "shared", PROMPTS[1], headers=headers).json()
            assert answer["model"] == "shared"
            assert answer["choices"][0]["text"] == text_of(server, reference(oracle, ids))
        # one series per name, both keys' requests in it (two adapters of one name would be a duplicate sample)
        samples = parse_samples(httpx.get(f"{server.url}/metrics").text)
        assert samples['simple_serve_lora_requests_total{adapter="shared"}'] == 2
        assert unload(server, "shared", OTHER).status_code == 200  # B unloads its own, A's stays
        answer = complete(server, "shared", PROMPTS[1]).json()
        assert answer["choices"][0]["text"] == text_of(server, reference(merged["beta"], ids))
        assert "'shared'" in error_of(complete(server, "shared", headers=OTHER), 404)["message"]
    finally:
        unload(server, "shared", OTHER)
        assert unload(server, "shared").status_code == 200


def test_load_inplace_by_another_key_loads_its_own_and_leaves_the_first_keys_adapter(server, adapters):
    _, merged = adapters
    ids = server.state.lm.encode_text(PROMPTS[0])
    assert load(server, "swap", "beta").status_code == 200
    try:
        assert load(server, "swap", "alpha", OTHER, load_inplace=True).status_code == 200
        assert complete(server, "swap").json()["choices"][0]["text"] == text_of(server, reference(merged["beta"], ids))
    finally:
        unload(server, "swap", OTHER)
        assert unload(server, "swap").status_code == 200


def test_one_key_cannot_take_every_slot_and_the_other_key_still_loads(server):
    names = ["a1", "a2", "a3"]
    try:
        assert [load(server, name, "beta").status_code for name in names[:2]] == [200, 200]
        error = error_of(load(server, "a3", "beta"), 400)
        assert "MAX_LORAS_PER_KEY=2" in error["message"] and error["param"] == "lora_name"
        assert [load(server, name, "beta", OTHER).status_code for name in ("b1", "b2")] == [200, 200]
        assert "MAX_LORAS_PER_KEY=2" in error_of(load(server, "b3", "beta", OTHER), 400)["message"]
        assert load(server, "a1", "alpha", load_inplace=True).status_code == 200  # a replacement takes no new slot
        assert unload(server, "a1").status_code == 200
        assert load(server, "a3", "beta").status_code == 200  # its own slot again
    finally:
        for name in names:
            unload(server, name)
        for name in ("b1", "b2"):
            unload(server, name, OTHER)
    assert models(server, AUTH) == models(server, OTHER) == ["tiny", "alpha"]


def test_max_loras_still_bounds_the_server_when_the_per_key_bound_is_wider(adapters, tiny_tokenizer):
    settings = lora_settings(adapters[0], max_loras=2, max_loras_per_key=2)
    with ThreadServer(create_app(settings, lm=fresh_lm(tiny_tokenizer))) as running:
        assert load(running, "one", "beta").status_code == 200
        assert "MAX_LORAS=2" in error_of(load(running, "two", "beta"), 400)["message"]


def test_the_per_key_default_is_half_the_runtime_slots_and_all_of_them_for_a_single_key():
    keys = f"{KEY},{OTHER_KEY}"
    assert Settings(model="tiny", api_key=keys, max_loras=4).loras_per_key == 2
    assert Settings(model="tiny", api_key=keys, max_loras=5, lora_modules="a=/x").loras_per_key == 2
    assert Settings(model="tiny", api_key=keys, max_loras=2, lora_modules="a=/x").loras_per_key == 1
    assert Settings(model="tiny", api_key=KEY, max_loras=4).loras_per_key == 4
    assert Settings(model="tiny", api_key=keys, max_loras=4, max_loras_per_key=3).loras_per_key == 3
    with pytest.raises(ValueError):
        Settings(model="tiny", max_loras_per_key=0)
