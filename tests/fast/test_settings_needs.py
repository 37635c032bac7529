"""Settings that cannot take effect without another are refused at start, naming both, rather than ignored:
METRICS_REQUIRE_KEY without API_KEY would leave /metrics open while the operator believes it closed (runtime LoRA
loading's own pairs are in test_lora_api.py). `python -m app serve` prints the message, not a traceback."""

from __future__ import annotations

import pytest

from app.__main__ import main
from app.config import Settings


def test_metrics_require_key_without_an_api_key_is_refused_naming_both():
    with pytest.raises(ValueError, match="METRICS_REQUIRE_KEY=true needs API_KEY"):
        Settings(model="tiny", metrics_require_key=True)
    with pytest.raises(ValueError, match="METRICS_REQUIRE_KEY=true needs API_KEY"):
        Settings(model="tiny", metrics_require_key=True, api_key=" , ")  # no key in it
    assert Settings(model="tiny", metrics_require_key=True, api_key="k").metrics_require_key


@pytest.mark.parametrize("env, named", [
    ({"METRICS_REQUIRE_KEY": "true"}, ("METRICS_REQUIRE_KEY", "API_KEY")),
    ({"LORA_RUNTIME_LOADING": "true", "LORA_ADAPTER_ROOT": "/srv/adapters"}, ("LORA_RUNTIME_LOADING", "API_KEY")),
    ({"LORA_RUNTIME_LOADING": "true", "API_KEY": "secret-key-1"}, ("LORA_RUNTIME_LOADING", "LORA_ADAPTER_ROOT")),
    ({"BATCH_INVARIANT": "on", "DECODE_STEP": "compiled"}, ("BATCH_INVARIANT", "DECODE_STEP")),
])
def test_serve_prints_the_refusal_naming_both_settings_and_exits_2(env, named, monkeypatch, capsys):
    for name in ("API_KEY", "METRICS_REQUIRE_KEY", "LORA_RUNTIME_LOADING", "LORA_ADAPTER_ROOT", "LORA_MODULES",
                 "BATCH_INVARIANT", "DECODE_STEP"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "--model", "tiny"]) == 2  # refused before the server's imports: nothing is loaded
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert all(name in err for name in named), err
    assert "secret-key-1" not in err  # pydantic's own message would echo every input, the key too
