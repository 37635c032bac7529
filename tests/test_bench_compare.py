"""`python -m app bench compare` end to end, on the tiny model saved to disk: it starts ours and
`transformers serve` as real processes, drives both with the same load and prints one table with ratios."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.config import Settings

from conftest import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.server
SETTINGS_ENV = {name.upper() for name in Settings.model_fields}


def bench(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k.upper() not in SETTINGS_ENV}  # no stray PORT, MODEL, ...
    return subprocess.run([sys.executable, "-m", "app", "bench", "compare", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env={**env, "PYTHONPATH": str(ROOT)})


def test_compare_runs_ours_and_transformers_serve_on_the_same_load(tmp_path, tiny_tokenizer):
    model_dir = tmp_path / "tiny"
    build_tiny_model(len(tiny_tokenizer)).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    out = tmp_path / "compare.json"
    done = bench("--model", str(model_dir), "--servers", "ours,transformers", "--dtype", "float32",
                 "--single-requests", "2", "--loaded-requests", "4", "--concurrency", "2", "--prompt-len", "20",
                 "--max-tokens", "8", "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"1 stream", "2 streams"}
    for scenario, requests in (("1 stream", 2), ("2 streams", 4)):
        for server in ("ours", "transformers"):
            r = report["results"][scenario][server]
            assert r["requests"] == {"total": requests, "succeeded": requests, "failed": 0}, r["errors"]
            assert r["ttft_s"]["p50"] > 0 and r["output_tokens_per_s"]["aggregate"] > 0
            assert 0 < r["completion_tokens_total"] <= requests * 8
    assert "ours/this" in done.stdout and "transformers" in done.stdout and "1.00x" in done.stdout
    # where and how it ran, and the ratios the docs cite, from the unrounded figures
    assert report["bench"] == "compare" and report["machine"]["cores"] >= 1 and report["versions"]["transformers"]
    assert report["settings"]["servers"] == "ours,transformers" and report["date"].endswith("Z")
    rate = {s: report["results"]["1 stream"][s]["output_tokens_per_s"]["aggregate"] for s in ("ours", "transformers")}
    assert report["ratios"]["ours_vs"]["1 stream"]["transformers"] == pytest.approx(rate["ours"] / rate["transformers"])


def test_bad_arguments_are_named(tmp_path):
    done = bench("--servers", "ours,vllm", cwd=tmp_path)
    assert done.returncode != 0 and "--servers" in done.stderr and "vllm" in done.stderr
    done = bench("--model", str(tmp_path), "--servers", "ours", cwd=tmp_path)
    assert done.returncode != 0 and "--model" in done.stderr and "config.json" in done.stderr
    done = bench("--ignore-eos", cwd=tmp_path)  # transformers serve answers ignore_eos with a 422
    assert done.returncode != 0 and "--ignore-eos" in done.stderr


def test_llamacpp_and_int8_server_commands(tmp_path):
    from argparse import Namespace

    from app.bench import compare, llamacpp

    args = Namespace(device="cpu", dtype="bfloat16", concurrency=8)
    ours = compare.server_command("ours-int8", tmp_path, 8001, args)
    assert ours[ours.index("--quant") + 1] == "int8" and ours[ours.index("--dtype") + 1] == "auto"
    plain = compare.server_command("ours", tmp_path, 8001, args)
    assert plain[plain.index("--quant") + 1] == "none" and plain[plain.index("--dtype") + 1] == "bfloat16"
    binary, gguf = tmp_path / "llama-server", tmp_path / "m.gguf"
    peer = compare.server_command("llama.cpp", tmp_path, 8002, args, binary, gguf)
    assert peer[0] == str(binary) and peer[peer.index("-m") + 1] == str(gguf)
    assert peer[peer.index("--port") + 1] == "8002" and peer[peer.index("-np") + 1] == "8"
    assert peer[peer.index("-c") + 1] == str(8 * 2048)  # each of the 8 slots gets 2,048 tokens of context
    configure, build = llamacpp.build_commands(tmp_path / "src", tmp_path / "build", jobs=2)
    assert configure[:2] == ["cmake", "-S"] and "-DLLAMA_CURL=OFF" in configure and "-DGGML_NATIVE=ON" in configure
    assert build[-3:] == ["--target", "llama-server", "-j2"]


def test_llamacpp_is_skipped_with_a_message_without_cmake(tmp_path, monkeypatch, capsys):
    from argparse import Namespace

    from app.bench import compare, llamacpp

    monkeypatch.setenv("MODEL_CACHE", str(tmp_path))
    monkeypatch.setattr(llamacpp.shutil, "which", lambda tool: None if tool == "cmake" else f"/usr/bin/{tool}")
    binary, gguf, kinds, build = compare.prepare_llamacpp(Namespace(model="qwen2.5-coder-0.5b-instruct"),
                                                          ["ours", "llama.cpp"])
    assert (binary, gguf, kinds, build) == (None, None, ["ours"], None)
    assert "llama.cpp skipped: cmake not found" in capsys.readouterr().out
    # a local model directory has no GGUF for llama.cpp to serve
    assert compare.prepare_llamacpp(Namespace(model=str(tmp_path)), ["llama.cpp", "ours"])[2] == ["ours"]
    assert "not an embedded model" in capsys.readouterr().out
