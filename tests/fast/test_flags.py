"""`python -m app serve`'s flags are made from `Settings`: one per field, its help the field's description, each
reaching `Settings` as its env var would, over the env var; the spellings operators already use keep working."""

from __future__ import annotations

import argparse

import pytest

from app.__main__ import main
from app.config import Settings
from app.flags import add_settings_flags, flag, settings_from


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_settings_flags(parser)
    return parser


def parsed(*argv: str) -> Settings:
    return settings_from(serve_parser().parse_args(list(argv)))


def test_every_setting_is_a_serve_flag_with_its_description_as_help(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    for name, field in Settings.model_fields.items():
        assert flag(name) in shown, name
        assert " ".join((field.description or "").split()) in shown, name
        assert f"env {name.upper()}" in shown, name
    assert "--no-prepack" in shown


def test_the_flags_operators_use_reach_settings(monkeypatch):
    for name in Settings.model_fields:
        monkeypatch.delenv(name.upper(), raising=False)
    s = parsed("--model", "m", "--served-model-name", "id", "--host", "0.0.0.0", "--port", "8123", "--device", "cpu",
               "--dtype", "float32", "--quant", "int8", "--api-key", "k", "--max-active", "3", "--max-queue", "0",
               "--max-model-len", "512", "--max-request-bytes", "4096", "--default-max-tokens", "7",
               "--prefill-tokens-per-step", "32", "--tensor-parallel", "2", "--kv-cache-bytes", "8GiB",
               "--shutdown-grace-s", "1.5", "--cors-origins", "https://a.example,https://b.example",
               "--prefix-cache-bytes", "0", "--speculative", "off", "--decode-step", "compiled",
               "--log-level", "DEBUG", "--model-cache", "/tmp/models", "--grammar-compile-timeout-s", "2")
    assert (s.model, s.model_id, s.host, s.port, s.device, s.dtype, s.quant, s.api_key) == (
        "m", "id", "0.0.0.0", 8123, "cpu", "float32", "int8", "k")
    assert (s.max_active, s.max_queue, s.max_model_len, s.max_request_bytes, s.default_max_tokens) == (
        3, 0, 512, 4096, 7)
    assert (s.prefill_tokens_per_step, s.tensor_parallel, s.kv_cache_bytes, s.shutdown_grace_s) == (
        32, 2, 8 * 2**30, 1.5)
    assert s.cors_origins == ["https://a.example", "https://b.example"]
    assert (s.prefix_cache_bytes, s.speculative, s.decode_step, s.log_level) == (0, "off", "compiled", "debug")
    assert str(s.model_cache) == "/tmp/models" and s.grammar_compile_timeout_s == 2.0


@pytest.mark.parametrize("argv,mode", [([], "auto"), (["--prepack"], "true"), (["--prepack", "false"], "false"),
                                       (["--prepack", "auto"], "auto"), (["--no-prepack"], "false")])
def test_prepack_keeps_its_spellings(argv, mode, monkeypatch):
    monkeypatch.delenv("PREPACK", raising=False)
    assert parsed(*argv).prepack == mode


def test_a_flag_overrides_its_env_var_and_a_flag_left_out_leaves_it(monkeypatch):
    monkeypatch.setenv("MAX_ACTIVE", "3")
    monkeypatch.setenv("PREPACK", "false")
    assert parsed("--max-active", "5").max_active == 5
    assert parsed().max_active == 3 and parsed().prepack == "false"
    assert parsed("--prepack").prepack == "true"


def test_a_bad_flag_value_is_refused_naming_the_setting(capsys):
    assert main(["serve", "--max-active", "0"]) == 2
    assert "max_active" in capsys.readouterr().err
    assert main(["serve", "--device", "tpu"]) == 2
    assert "device" in capsys.readouterr().err


def test_generate_takes_the_model_flags_from_settings_too(monkeypatch):
    monkeypatch.delenv("DTYPE", raising=False)
    parser = argparse.ArgumentParser()
    add_settings_flags(parser, ("model", "dtype", "prepack"))
    args = parser.parse_args(["--model", "m", "--dtype", "bfloat16", "--no-prepack"])
    settings = settings_from(args, keys=("model", "dtype", "prepack"))
    assert (settings.model, settings.dtype, settings.prepack) == ("m", "bfloat16", "false")
    with pytest.raises(SystemExit):
        parser.parse_args(["--port", "1"])  # generate has no server flags
