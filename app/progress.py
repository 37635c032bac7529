"""Progress bars where a person waits: the first fetch and conversion of a model, and the llama.cpp build.

tqdm draws them (pinned in pyproject.toml; transformers depends on it already). A bar is drawn only when stderr is
a terminal: under `make test`, in CI or with stderr sent to a file, the log lines say the same thing once each,
instead of a stream of carriage returns.
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import BinaryIO

from tqdm import tqdm

# make's "[ 45%] Building CXX object ..." and ninja's "[12/345] Building CXX object ...": how far a build is.
BUILD_STEP = re.compile(rb"^\[\s*(\d+)%\]|^\[(\d+)/(\d+)\]")


def bar(**kwargs) -> tqdm:
    return tqdm(file=sys.stderr, disable=not sys.stderr.isatty(), dynamic_ncols=True, **kwargs)


def note(message: str) -> None:
    """A log line on stderr that does not tear a bar being drawn (tqdm moves the bar below it)."""
    tqdm.write(message, file=sys.stderr)
    sys.stderr.flush()


def run_with_progress(command: list[str], log: BinaryIO, desc: str) -> None:
    """Run a build with its output going to `log`, and a bar that follows its step counts; raises as check=True."""
    with bar(total=100, desc=desc, unit="%", bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}]") as shown, \
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        for line in proc.stdout:
            log.write(line)
            if step := BUILD_STEP.match(line):
                done = int(step[1]) if step[1] else 100 * int(step[2]) // int(step[3])
                shown.update(max(0, done - shown.n))
        if proc.wait() != 0:
            raise subprocess.CalledProcessError(proc.returncode, command)
