"""Progress bars where a person waits: the first fetch and conversion of a model (and, in benchmarks/, the llama.cpp
build).

tqdm draws them (pinned in pyproject.toml; transformers depends on it already). A bar is drawn only when stderr is
a terminal: under `make test`, in CI or with stderr sent to a file, the log lines say the same thing once each,
instead of a stream of carriage returns.
"""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

as_log_records = False  # LOG_FORMAT=json: notes become log records (one JSON object per line), bars are off


def bar(**kwargs) -> tqdm:
    return tqdm(file=sys.stderr, disable=as_log_records or not sys.stderr.isatty(), dynamic_ncols=True, **kwargs)


def note(message: str) -> None:
    """A log line on stderr that does not tear a bar being drawn (tqdm moves the bar below it)."""
    if as_log_records:
        logging.getLogger("app.progress").info(message)
        return
    tqdm.write(message, file=sys.stderr)
    sys.stderr.flush()
