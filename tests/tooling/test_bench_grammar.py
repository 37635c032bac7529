"""`bench grammar` on the tiny model: both parts run and report figures."""

from __future__ import annotations

import argparse
import json

from benchmarks.grammar import SCHEMA, add_arguments, run, time_decode, time_engines
from app.core.runner.packed import enable_packed_batching
from app.structured.grammars import Grammars


def test_engines_and_decode_figures(tiny_lm):
    engines = time_engines(tiny_lm.tokenizer, tiny_lm.vocab_size, list(tiny_lm.eos_ids), [1, 2])
    assert engines["xgrammar"]["compile_ms"] > 0 and engines["xgrammar"]["step_ms_b2"] > 0
    assert "llguidance" not in engines or engines["llguidance"]["step_ms_b1"] > 0
    assert enable_packed_batching(tiny_lm.model)
    grammar = Grammars(tiny_lm.tokenizer, tiny_lm.vocab_size, tiny_lm.eos_ids).json_schema(SCHEMA)
    assert time_decode(tiny_lm, 2, 3, grammar) > 0 and time_decode(tiny_lm, 2, 3, None) > 0


def test_the_json_names_the_machine_and_holds_the_figures(tiny_dir, tmp_path):
    """What `--out` writes is what docs/results/ keeps: the record envelope first, then the figures."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_dir), "--device", "cpu", "--batches", "1", "--steps", "2",
                              "--out", str(tmp_path / "grammar.json")])
    run(args)
    report = json.loads((tmp_path / "grammar.json").read_text())
    assert report["bench"] == "grammar" and report["machine"]["cores"] >= 1 and report["settings"]["steps"] == 2
    assert report["engines"]["xgrammar"]["step_ms_b1"] > 0 and report["decode_b1"]["plain_ms"] > 0
