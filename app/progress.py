"""Progress bars where a person waits: the first fetch and conversion of a model (and, in benchmarks/, the llama.cpp
build).

tqdm draws them (pinned in pyproject.toml; transformers depends on it already). A bar is drawn only when stderr is
a terminal: under `make test`, in CI or with stderr sent to a file, the log lines say the same thing once each,
instead of a stream of carriage returns.
"""

from __future__ import annotations

import sys

from tqdm import tqdm


def bar(**kwargs) -> tqdm:
    return tqdm(file=sys.stderr, disable=not sys.stderr.isatty(), dynamic_ncols=True, **kwargs)


def note(message: str) -> None:
    """A log line on stderr that does not tear a bar being drawn (tqdm moves the bar below it)."""
    tqdm.write(message, file=sys.stderr)
    sys.stderr.flush()
