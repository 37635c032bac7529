"""`python -m benchmarks compare` end to end, on the tiny model saved to disk: it starts ours and
`transformers serve` as real processes, drives both with the same load and prints one table with ratios. The
rest runs on fake servers: short scripts whose first token waits in proportion to the prompt, and that can die at
a prompt of a given length, so what the report records is known in advance."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.config import Settings

from conftest import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.server
SETTINGS_ENV = {name.upper() for name in Settings.model_fields}


def bench(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k.upper() not in SETTINGS_ENV}  # no stray PORT, MODEL, ...
    return subprocess.run([sys.executable, "-m", "benchmarks", "compare", *argv], cwd=cwd, capture_output=True,
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
    from concurrent.futures import ThreadPoolExecutor

    cases = [("--servers", "ours,vllm"), ("--model", str(tmp_path), "--servers", "ours"),
             ("--ignore-eos",)]  # transformers serve answers ignore_eos with a 422
    with ThreadPoolExecutor(len(cases)) as pool:  # three CLI starts side by side: most of each is importing torch
        servers, model, ignore_eos = pool.map(lambda argv: bench(*argv, cwd=tmp_path), cases)
    assert servers.returncode != 0 and "--servers" in servers.stderr and "vllm" in servers.stderr
    assert model.returncode != 0 and "--model" in model.stderr and "config.json" in model.stderr
    assert ignore_eos.returncode != 0 and "--ignore-eos" in ignore_eos.stderr


def test_llamacpp_and_int8_server_commands(tmp_path):
    from argparse import Namespace

    from benchmarks import compare, llamacpp

    args = Namespace(device="cpu", dtype="bfloat16", concurrency=8)
    ours = compare.server_command("ours-int8", tmp_path, 8001, args)
    assert ours[ours.index("--quant") + 1] == "int8" and ours[ours.index("--dtype") + 1] == "auto"
    plain = compare.server_command("ours", tmp_path, 8001, args)
    assert plain[plain.index("--quant") + 1] == "none" and plain[plain.index("--dtype") + 1] == "bfloat16"
    compiled = compare.server_command("ours-compiled", tmp_path, 8001, args)
    assert compiled[0] == "env" and compiled[len(compare.COMPILED) + 1:] == plain
    invariant, variant = (compare.server_command(k, tmp_path, 8001, args) for k in ("ours-invariant", "ours-variant"))
    assert invariant == ["env", "BATCH_INVARIANT=on", *plain] and variant == ["env", "BATCH_INVARIANT=off", *plain]
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

    from benchmarks import compare, llamacpp

    monkeypatch.setenv("MODEL_CACHE", str(tmp_path))
    monkeypatch.setattr(llamacpp.shutil, "which", lambda tool: None if tool == "cmake" else f"/usr/bin/{tool}")
    binary, gguf, kinds, build = compare.prepare_llamacpp(Namespace(model="qwen2.5-coder-0.5b-instruct"),
                                                          ["ours", "llama.cpp"])
    assert (binary, gguf, kinds, build) == (None, None, ["ours"], None)
    assert "llama.cpp skipped: cmake not found" in capsys.readouterr().out
    # a local model directory has no GGUF for llama.cpp to serve
    assert compare.prepare_llamacpp(Namespace(model=str(tmp_path)), ["llama.cpp", "ours"])[2] == ["ours"]
    assert "not an embedded model" in capsys.readouterr().out


# -- on fake servers ------------------------------------------------------------------------------------

# A fake OpenAI-compatible server: it streams a few tokens after a first-token delay proportional to the prompt,
# reports the prompt tokens it counted (a quarter of the characters, plus 10 for a chat template) and logs every
# prompt it got. It dies (SIGKILL, as the OOM killer would) at the first prompt longer than DIES_OVER characters.
FAKE_SERVER = r"""
import http.server, json, os, signal, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
kind, seconds_per_token, dies_over, log = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][-1]["content"]
        with open(log, "a") as f:
            f.write(json.dumps({"server": kind, "prompt": prompt, "cwd": os.getcwd()}) + "\n")
        if 0 <= dies_over < len(prompt):
            os.kill(os.getpid(), signal.SIGKILL)
        tokens = len(prompt) // 4 + 10
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(seconds_per_token * tokens)
        for _ in range(body["max_tokens"]):
            self.wfile.write(b'data: {"choices": [{"index": 0, "delta": {"content": "a "}}]}\n\n')
            self.wfile.flush()
        usage = {"prompt_tokens": tokens, "completion_tokens": body["max_tokens"]}
        self.wfile.write(("data: " + json.dumps({"choices": [], "usage": usage}) + "\n\ndata: [DONE]\n\n").encode())


http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def compare_on_fakes(tmp_path, monkeypatch, behaviour: dict[str, tuple[float, int]], *argv: str) -> tuple[dict, list]:
    """`bench compare` with each server a fake: behaviour[kind] = (seconds per prompt token, dies over N chars or
    -1). Returns the report and the prompts the servers got, in order."""
    from benchmarks import compare

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    script, log = tmp_path / "fake_server.py", tmp_path / "prompts.jsonl"
    script.write_text(FAKE_SERVER)
    monkeypatch.setattr(compare, "prepare_llamacpp", lambda args, kinds: (None, None, kinds, "native: fake"))
    monkeypatch.setattr(compare, "server_command", lambda kind, model_dir, port, args, *_: [
        sys.executable, str(script), kind, str(behaviour[kind][0]), str(behaviour[kind][1]), str(log),
        "--port", str(port)])
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    args = parser.parse_args(["--model", str(model), "--servers", ",".join(behaviour), "--concurrency", "2",
                              "--single-requests", "1", "--loaded-requests", "2", "--max-tokens", "4",
                              "--prompt-len", "20", "--out", str(tmp_path / "compare.json"), "--ready-timeout", "60",
                              *argv])
    report = compare.run(args)
    assert json.loads((tmp_path / "compare.json").read_text()) == report
    return report, [json.loads(line) for line in log.read_text().splitlines()]


def test_a_server_that_crashes_says_so_and_is_never_compared(tmp_path, monkeypatch, capsys):
    """llama.cpp dies at its first request: every scenario records it as crashed, it gets no ratio, and the docs'
    table gives it a row that says so and holds no figure, so failed requests cannot read as a win."""
    from benchmarks import tables

    behaviour = {"ours": (0.0002, -1), "llama.cpp": (0.0001, 0)}
    report, _ = compare_on_fakes(tmp_path, monkeypatch, behaviour)
    for scenario in ("1 stream", "2 streams"):
        assert report["results"][scenario]["llama.cpp"] == {"crashed": "crashed during the run (exit -9 (SIGKILL))"}
        assert report["results"][scenario]["ours"]["requests"]["succeeded"] > 0
        assert report["ratios"]["ours_vs"][scenario].get("llama.cpp") is None
    table = tables.compare_table([("compare.json", report)])
    assert "| llama.cpp `llama-server` | crashed |  |  |  |  |" in table.splitlines()
    assert "| simple-serve, defaults | " in table


def test_prompts_are_counted_with_the_models_tokenizer(tmp_path, tiny_tokenizer):
    from benchmarks import prompt_lengths

    tiny_tokenizer.save_pretrained(tmp_path)
    count, counted_with = prompt_lengths.token_counter(tmp_path)
    assert counted_with == "the model's tokenizer"
    prompts = prompt_lengths.build([64, 300], 2, count)
    for length, texts in prompts.items():
        tokens = [len(tiny_tokenizer.encode(t, add_special_tokens=False)) for t in texts]
        assert all(length <= n < length + 80 for n in tokens), tokens  # overshoots by at most one passage
    with pytest.raises(SystemExit, match="--prompt-lens"):
        prompt_lengths.parse("128,1k")
    assert prompt_lengths.parse("") == [] and prompt_lengths.parse("1200, 128,128") == [128, 1200]


def test_no_scenario_repeats_a_prompt_a_server_has_already_seen(tmp_path, monkeypatch):
    """Ours and llama.cpp keep a prompt cache, transformers does not: a scenario that resent the warm-up's prompts
    would time cache hits for two servers and full prefills for the third."""
    _, sent = compare_on_fakes(tmp_path, monkeypatch, {"ours": (0.0001, -1), "transformers": (0.0001, -1)})
    for kind in ("ours", "transformers"):
        prompts = [s["prompt"] for s in sent if s["server"] == kind]
        assert len(prompts) == 2 + 1 + 2  # warm-up, 1 stream, 2 streams
        assert len(set(prompts)) == len(prompts)


def test_the_compiled_servers_settings_are_the_ones_under_which_the_compiled_step_runs(monkeypatch):
    from benchmarks import compare
    from app.config import Settings

    for assignment in compare.COMPILED:
        monkeypatch.setenv(*assignment.split("=", 1))
    settings, default = Settings(), Settings(_env_file=None, decode_step="eager", prepack="auto")
    assert settings.decode_step == "compiled" and settings.prepack in (False, "false")
    assert (settings.prefix_cache_bytes, settings.speculative) == (default.prefix_cache_bytes, default.speculative)


def test_the_mixed_workload_runs_after_the_two_loads_and_prints_its_table(tmp_path, monkeypatch, capsys):
    """`--mixed-requests N` adds a third scenario: every server gets the same mixed prompts, and the summary lines
    still compare one stream with N streams (a third scenario once broke that summary after the report was
    written)."""
    from benchmarks.compare import MIXED

    report, sent = compare_on_fakes(tmp_path, monkeypatch, {"ours": (0.00005, -1), "llama.cpp": (0.00005, -1)},
                                    "--mixed-requests", "3")
    assert list(report["results"]) == ["1 stream", "2 streams", MIXED]
    assert all(report["results"][MIXED][kind]["requests"]["succeeded"] == 3 for kind in ("ours", "llama.cpp"))
    mixed = {kind: [s["prompt"] for s in sent if s["server"] == kind][-3:] for kind in ("ours", "llama.cpp")}
    assert sorted(mixed["ours"]) == sorted(mixed["llama.cpp"])  # the same work for both
    out = capsys.readouterr().out
    assert "ours, loaded vs 1 stream:" in out and f"{MIXED}: same prompts and answer lengths" in out


def test_before_serves_an_earlier_checkout_beside_ours_in_the_same_run(tmp_path, monkeypatch):
    """`--before DIR` adds 'ours-before': the same server command, started in DIR (where `python -m app` imports
    that checkout's package), measured on the same load as ours and compared with it."""
    old = tmp_path / "old"
    (old / "app").mkdir(parents=True)
    (old / "app" / "__main__.py").write_text("")
    git = ["git", "-C", str(old), "-c", "user.name=t", "-c", "user.email=t@t"]
    for argv in (["init", "-q"], ["add", "."], ["commit", "-qm", "old"]):
        subprocess.run(git + argv, check=True)
    commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    report, sent = compare_on_fakes(tmp_path, monkeypatch, {"ours": (0.00005, -1), "ours-before": (0.0002, -1)},
                                    "--servers", "ours", "--before", str(old))
    assert report["ours-before"] == {"dir": str(old.resolve()), "commit": commit}
    for scenario in ("1 stream", "2 streams"):
        assert list(report["results"][scenario]) == ["ours", "ours-before"]
        assert report["ratios"]["ours_vs"][scenario]["ours-before"] > 0
    cwd = {s["server"]: s["cwd"] for s in sent}
    assert cwd["ours-before"] == str(old.resolve()) and cwd["ours"] != str(old.resolve())


def test_before_must_be_a_checkout_of_this_repository(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="--before: .* is not a checkout of this repository"):
        compare_on_fakes(tmp_path, monkeypatch, {"ours": (0.00005, -1)}, "--before", str(tmp_path))
