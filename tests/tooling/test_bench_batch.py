"""`python -m benchmarks batch` on the tiny model: it runs both loads and prints the figures the issue asks for."""

from __future__ import annotations

import json

import pytest

from benchmarks.__main__ import main

pytestmark = pytest.mark.server


def test_the_batch_bench_prints_idle_and_loaded_figures_and_their_ratios(tiny_dir, tmp_path, capsys):
    out = tmp_path / "batch.json"
    assert main(["batch", "--model", str(tiny_dir), "--lines", "30", "--line-tokens", "16", "--requests", "3",
                 "--tokens", "8", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "first token p50" in printed and "ratio" in printed and "resident memory" in printed
    report = json.loads(out.read_text())
    assert report["idle"]["failed"] == 0 and report["with_batch"]["failed"] == 0
    assert report["idle"]["ttft_p50_s"] > 0 and report["with_batch"]["tokens_per_s_p50"] > 0
    assert report["ttft_ratio"] is not None and report["server_rss_mib"] > 0
