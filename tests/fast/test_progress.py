"""Progress bars (app/progress.py): drawn on a terminal, silent elsewhere; and the llama.cpp build's bar
(benchmarks/llamacpp.py) follows its steps while every line of its output still reaches the log."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from app import progress
from benchmarks import llamacpp

BUILD = ("import sys\n"
         "for line in ['-- Configuring done', '[ 10%] Building C object a.o', '[ 55%] Building CXX object b.o',\n"
         "             '[100%] Linking CXX executable bin/llama-server']:\n"
         "    print(line)\n"
         "sys.exit(int(sys.argv[1]))\n")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_bar_when_stderr_is_not_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with progress.bar(total=10, desc="fetch") as shown:
        shown.update(10)
    progress.note("[fetch-model] verified")
    assert sys.stderr.getvalue() == "[fetch-model] verified\n"  # the log line, and no bar


def test_a_build_bar_follows_make_steps_and_the_log_gets_every_line(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    log = io.BytesIO()
    llamacpp.run_with_progress([sys.executable, "-c", BUILD, "0"], log, "llama.cpp build")
    assert log.getvalue().decode().splitlines() == ["-- Configuring done", "[ 10%] Building C object a.o",
                                                    "[ 55%] Building CXX object b.o",
                                                    "[100%] Linking CXX executable bin/llama-server"]
    drawn = sys.stderr.getvalue()
    assert "llama.cpp build:   0%" in drawn and "llama.cpp build: 100%|##########|" in drawn


def test_ninja_steps_count_too():
    assert llamacpp.BUILD_STEP.match(b"[12/48] Building CXX object x.o").groups() == (None, b"12", b"48")
    assert llamacpp.BUILD_STEP.match(b"[ 55%] Building CXX object b.o").groups() == (b"55", None, None)
    assert llamacpp.BUILD_STEP.match(b"-- Build files have been written") is None


def test_a_failed_build_raises_as_check_true_does():
    with pytest.raises(subprocess.CalledProcessError) as failed:
        llamacpp.run_with_progress([sys.executable, "-c", BUILD, "3"], io.BytesIO(), "llama.cpp build")
    assert failed.value.returncode == 3
