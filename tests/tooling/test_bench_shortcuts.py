"""`bench shortcuts` starts each of its servers as `python -m app serve` with its own flags, and stops it: on the
tiny model, one server with speculation off answers as the bench would ask it (the full bench takes minutes)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import shortcuts

pytestmark = pytest.mark.server


def test_our_server_starts_with_its_flags_answers_and_stops(tiny_dir, tmp_path):
    parser = argparse.ArgumentParser()
    shortcuts.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_dir), "--dtype", "float32", "--ready-timeout", "120"])
    with shortcuts.our_server(args, tiny_dir, tmp_path / "shortcuts.json", "spec-off",
                              ["--speculative", "off"]) as url:
        result = shortcuts.chat(url, tiny_dir, "Hello there", max_tokens=8, temperature=0, ignore_eos=True)
        assert result.error is None and result.done and result.completion_tokens == 8
