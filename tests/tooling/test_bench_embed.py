"""`python -m benchmarks embed` end to end on a tiny random BERT: it starts our server on the directory, measures
each batch size against sentence-transformers' encode, and the two sides' vectors agree."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import embed
from embedding_models import build_tiny_bert_dir


def test_bench_embed_reports_embeddings_per_second_for_both_sides(tmp_path, capsys):
    pytest.importorskip("sentence_transformers")
    path = build_tiny_bert_dir(tmp_path / "tiny-bert")
    parser = argparse.ArgumentParser()
    embed.add_arguments(parser)
    out = tmp_path / "embed.json"
    report = embed.run(parser.parse_args(["--model", str(path), "--batches", "1,4", "--texts", "8", "--rounds", "1",
                                          "--out", str(out)]))
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert set(report["embeddings_per_s"]) == {1, 4}
    for figures in report["embeddings_per_s"].values():
        assert len(figures) == 3 and all(v > 0 for v in figures.values())
    assert report["worst_cosine"] >= 0.9999
    assert "sentence-transformers encode" in capsys.readouterr().out
