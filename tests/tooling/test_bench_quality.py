"""`python -m benchmarks quality` end to end on the tiny model: every variant loads (fp32 reference, bf16, int8
dynamic, int8 weight-only), and the report holds the figures docs/performance.md quotes."""

from __future__ import annotations

import argparse
import json

from benchmarks import quality, tables


def test_bench_quality_reports_every_variant_against_fp32(tiny_dir, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    quality.add_arguments(parser)
    out = tmp_path / "quality.json"
    args = parser.parse_args(["--model", str(tiny_dir), "--max-tokens", "6", "--window", "64", "--out", str(out)])
    report = quality.run(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    variants = report["variants"]
    assert set(variants) == {"fp32 (reference)", *quality.VARIANTS}
    for name in quality.VARIANTS:
        v = variants[name]
        assert v["perplexity"] > 1 and 0 <= v["teacher_forced_agreement"] <= 1
        assert len(v["identical_prefix_tokens"]) == len(quality.PROMPTS)
        assert all(0 <= n <= 6 for n in v["identical_prefix_tokens"])
    assert variants["bf16"]["dtype"] == "torch.bfloat16" and variants["int8"]["dtype"] == "torch.float32"
    assert "top-1 agreement" in capsys.readouterr().out
    # the JSON says where and how it ran, and the docs' table generator reads it as it is
    assert report["bench"] == "quality" and report["machine"]["cores"] >= 1 and report["machine"]["cpu"]
    assert report["versions"]["torch"] and report["date"].endswith("Z") and report["settings"]["max_tokens"] == 6
    table = tables.quality_table([("quality.json", report)])
    assert f"| bf16 | {variants['bf16']['perplexity']:.3f} | {variants['bf16']['vs_fp32']:+.2%} |" in table
