"""`python -m benchmarks scaling` end to end on a tiny shape, without llama.cpp: it writes the random-weight
checkpoint, serves it at the defaults, QUANT=int8 and QUANT=int4 one server at a time, and records each one's
tokens/s, idle TTFT, long-context decode and resident memory, with the weight bytes the server reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from app.config import Settings
from app.models.cpu import auto_dtype
from benchmarks import scaling

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_ENV = {name.upper() for name in Settings.model_fields}


def bench(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k.upper() not in SETTINGS_ENV}  # no stray PORT, MODEL, ...
    return subprocess.run([sys.executable, "-m", "benchmarks", "scaling", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=900, env={**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


@pytest.mark.server
def test_scaling_serves_a_tiny_shape_at_each_setting_and_records_memory(tmp_path, tiny_tokenizer):
    tokenizer = tmp_path / "tokenizer"
    tiny_tokenizer.save_pretrained(tokenizer)
    out = tmp_path / "scaling.json"
    earlier = {"parameters": 494032768, "shape": {}, "servers": {"ours": {"skipped": "an earlier run's entry"}}}
    out.write_text(json.dumps({"date": "2026-12-04T19:50:58Z", "sizes": {"0.5B": earlier, "tiny": earlier}}))
    done = bench("--sizes", "tiny", "--servers", "ours,ours-int8,ours-int4,ours-kv8", "--tokenizer", str(tokenizer),
                 "--work-dir", str(tmp_path / "work"), "--streams", "1,2", "--requests", "2", "--max-tokens", "6",
                 "--prompt-len", "20", "--prompt-lens", "16,160", "--ttft-requests", "1", "--long-context", "240",
                 "--out", str(out), "--resume", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    # --resume kept the size it did not run, with that run's date, and ran the one it was given afresh
    assert report["sizes"]["0.5B"] == {"date": "2026-12-04T19:50:58Z", **earlier}
    assert report["sizes"]["tiny"]["date"] >= report["date"][:10] and "ours-int4" in report["sizes"]["tiny"]["servers"]
    assert report["bench"] == "scaling" and report["machine"]["cores"] >= 1
    tiny = report["sizes"]["tiny"]
    assert tiny["shape"]["hidden_size"] == 64 and tiny["parameters"] > 0
    defaults = {torch.float32: "fp32", torch.bfloat16: "bf16"}[auto_dtype(torch.device("cpu"))[0]]  # the CPU's own
    formats = {"ours": defaults, "ours-int8": "int8", "ours-int4": "int4", "ours-kv8": defaults}
    for name, r in tiny["servers"].items():
        for scenario, requests in (("1 streams", 2), ("2 streams", 2), ("idle TTFT at 16 tokens", 1),
                                   ("idle TTFT at 160 tokens", 1), ("decode at 240 tokens of context", 1)):
            assert r[scenario]["requests"] == {"total": requests, "succeeded": requests, "failed": 0}, (name, scenario)
        assert r["1 streams"]["tokens_per_s"] > 0 and r["decode at 240 tokens of context"]["tokens_per_s"] > 0
        assert r["idle TTFT at 160 tokens"]["prompt_tokens"] > r["idle TTFT at 16 tokens"]["prompt_tokens"]
        memory = r["memory_after_first_request"]
        assert memory["rss"] >= memory["anon"] > 0 and memory["file"] >= 0
        assert r["memory_at_end"]["peak"] >= r["memory_at_end"]["rss"] > 0
        assert r["weight_bytes"][formats[name]] > 0, (name, r["weight_bytes"])
        assert scaling.long_context_ratio(r) == pytest.approx(  # long-context decode ÷ the 1-stream decode
            r["decode at 240 tokens of context"]["tokens_per_s"] * r["1 streams"]["itl_p50_s"])
    quantized = tiny["servers"]["ours-int4"]["weight_bytes"]
    assert quantized["total"] < tiny["servers"]["ours"]["weight_bytes"]["total"]
    assert "ours-int4" in done.stdout and "RSS MiB" in done.stdout and "peak MiB" in done.stdout
    assert "long/short" in done.stdout and "ours-kv8" in done.stdout
    from benchmarks import by_class, charts

    results = tmp_path / "results"  # as docs/results/ names a class's run: the class's table and chart take it
    results.mkdir()
    (results / "scaling-zen4-tiny.json").write_text(out.read_text())
    table = by_class.class_table("scaling-zen4*.json", [("scaling-zen4-tiny.json", report)])
    int4 = next(line for line in table.splitlines() if "`QUANT=int4`" in line).split(" | ")
    assert int4[2] == f"{tiny['servers']['ours-int4']['1 streams']['tokens_per_s']:.1f}"  # speed beside memory
    assert int4[5] == f"{tiny['servers']['ours-int4']['memory_after_first_request']['rss'] / 2**20:,.0f} MiB"
    assert int4[7].endswith("](results/scaling-zen4-tiny.json) |")  # the row names its run
    drawn = charts.draw_all(results, tmp_path / "figures")
    assert [p.name for p in drawn] == ["scaling-zen4.png", "headline.png"]


def test_llamacpp_gets_room_for_the_longest_context_and_bad_sizes_are_named(tmp_path):
    from benchmarks import scaling

    args = Namespace(long_context=4096, prompt_lens="128,2048", max_tokens=64)
    command = scaling.server_command("llama.cpp-Q4_K_M", tmp_path, tmp_path / "m.gguf", tmp_path / "llama-server",
                                     8001, args, [1, 8])
    slots, context = int(command[command.index("-np") + 1]), int(command[command.index("-c") + 1])
    assert slots == 8 and context // slots >= 4096 + 64
    ours = scaling.server_command("ours-int4", tmp_path, None, None, 8001, args, [1, 8])
    assert ours[ours.index("--quant") + 1] == "int4" and ours[ours.index("--dtype") + 1] == "auto"
    gguf = scaling.server_command("ours-gguf", tmp_path, tmp_path / "m.gguf", None, 8001, args, [1, 8])
    assert gguf[gguf.index("--model") + 1] == str(tmp_path / "m.gguf")  # llama.cpp's own file, its bits kept
    assert gguf[gguf.index("--quant") + 1] == "auto" and "ours-gguf" not in scaling.DEFAULT_SERVERS
    with pytest.raises(SystemExit, match="--sizes: unknown 13B"):
        scaling.parse_list("0.5B,13B", scaling.SHAPES, "--sizes")


@pytest.mark.server
def test_load_only_records_the_loads_memory_and_time_to_ready_and_no_speed(tmp_path, tiny_tokenizer):
    tokenizer = tmp_path / "tokenizer"
    tiny_tokenizer.save_pretrained(tokenizer)
    out = tmp_path / "load.json"
    done = bench("--sizes", "tiny", "--servers", "ours-int8", "--tokenizer", str(tokenizer), "--work-dir",
                 str(tmp_path / "work"), "--load-only", "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    served = json.loads(out.read_text())["sizes"]["tiny"]["servers"]["ours-int8"]
    assert not [k for k in served if k.endswith(" streams") or k.startswith(("idle TTFT", "decode at"))], served
    # VmHWM is at least VmRSS within one read of /proc (the kernel takes the larger), not against an earlier read
    assert served["ready_s"] > 0 and served["memory_at_end"]["peak"] >= served["memory_at_end"]["rss"] > 0
    assert served["memory_after_first_request"]["rss"] > 0
    assert served["weight_bytes"]["int8"] > 0
    from benchmarks import by_class

    row = next(line for line in by_class.class_table("scaling-zen4*.json", [("load.json", json.loads(out.read_text()))])
               .splitlines() if "`QUANT=int8`" in line).split(" | ")
    # memory alone: the speed cells say it was not measured, and the peak is the load's high-water mark
    assert row[2:4] == ["not measured", "not measured"]
    assert row[6] == f"{served['memory_after_first_request']['peak'] / 2**20:,.0f} MiB"
