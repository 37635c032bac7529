"""What the server writes to its log stays small and one line per record, whatever a request holds.

- `bounded_traceback`: a traceback whose frames are each shown the first time their line appears (at most
  `HEAD_FRAMES`), then the last `TAIL_FRAMES`; each exception message cut to `MAX_MESSAGE_CHARS`, the whole to
  `MAX_TRACEBACK_CHARS`. Python's own formatting writes every frame, folding only a line repeated right after
  itself: one RecursionError through two alternating functions (a 1.5 KB body nested 600 deep) wrote
  512 KB, and three clients grew the log by 101 MiB in 10 s. The outer frames say which route and call it came
  through, the inner ones where it broke; the thousand repeats between them say nothing more.
- `escape_controls`: control characters (newline, carriage return, escape...) written as `\\n`, `\\x1b`, so that a
  URL path such as `/x%0a2026-12-02 ... 200` cannot forge a line of its own in the access log.
- `LogFormatter`: the process's formatter (`run_server`), doing both for every logger, uvicorn's included.
- `JsonFormatter` (LOG_FORMAT=json): the same records, each one JSON object on one line (JSON escapes every control
  character), with the request id (app/request_id.py) and, on the access line, the request's fields.
"""

from __future__ import annotations

import json
import logging
import re
import traceback
from datetime import datetime, timezone
from typing import Any

HEAD_FRAMES = 60  # distinct lines: a route's whole way down (about 35) and more
TAIL_FRAMES = 12
MAX_CHAIN = 3  # exceptions shown along __cause__ / __context__
MAX_MESSAGE_CHARS = 1_000
MAX_TRACEBACK_CHARS = 16_000
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape_controls(text: str) -> str:
    """`text` on one line: each control character as a Python escape (`\\n`, `\\t`, `\\x1b`)."""
    return _CONTROLS.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} characters left out)"


def _one(err: BaseException) -> list[str]:
    """One exception: each frame the first time its line appears (a recursion's frames repeat the same few lines),
    at most `HEAD_FRAMES` of them, then the last `TAIL_FRAMES`, and its message. Only kept frames have their
    source lines read."""
    frames = list(traceback.walk_tb(err.__traceback__))
    tail_from = max(0, len(frames) - TAIL_FRAMES)
    seen: set = set()
    kept: list[int] = []
    for i, (frame, lineno) in enumerate(frames[:tail_from]):
        if (frame.f_code, lineno) not in seen and len(kept) < HEAD_FRAMES:
            kept.append(i)
        seen.add((frame.f_code, lineno))
    kept += range(tail_from, len(frames))
    stack = traceback.StackSummary.extract(iter([frames[i] for i in kept]), lookup_lines=True)
    lines, last = ["Traceback (most recent call last):\n"], -1
    for i, summary in zip(kept, stack):
        if i > last + 1:
            lines.append(f"  ... {i - last - 1} frames left out (repeats of the lines above, or past {HEAD_FRAMES})\n")
        lines.append(stack.format_frame_summary(summary))
        last = i
    message = _cut("".join(traceback.format_exception_only(type(err), err)).strip(), MAX_MESSAGE_CHARS)
    return lines + [message + "\n"]


def bounded_traceback(err: BaseException) -> str:
    """Like `traceback.format_exception`, bounded: the exception first, then what it came from, if anything."""
    parts, seen = _one(err), {id(err)}
    cause = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    while cause is not None and id(cause) not in seen and len(seen) < MAX_CHAIN:
        seen.add(id(cause))
        parts += ["\nwhich came from:\n", *_one(cause)]
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    return _cut("".join(parts).rstrip("\n"), MAX_TRACEBACK_CHARS)


class LogFormatter(logging.Formatter):
    """Each record's message on one line (control characters escaped) and its traceback, if any, bounded."""

    def format(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.getMessage())
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        text = self.formatMessage(record)
        # never the record's cached exc_text: another handler's formatter may have written it, unbounded
        exc_text = self.formatException(record.exc_info) if record.exc_info else record.exc_text
        if exc_text:
            text += "\n" + exc_text
        if record.stack_info:
            text += "\n" + self.formatStack(record.stack_info)
        return text

    def formatException(self, ei) -> str:  # noqa: N802 (logging's name)
        return bounded_traceback(ei[1]) if ei[1] is not None else ""


def served_model(info: dict[str, Any], base_id: str) -> str:
    """The model a request's answer names (its request.state `info`): the LoRA adapter it ran with, else the base.
    The access line and the trace's span say the same."""
    choices = info.get("choices") or []
    adapter = getattr(choices[0].handle, "adapter", None) if choices else None
    return adapter.name if adapter is not None else base_id


# The access line's fields (app/main.py `AccessAndLimits._log`), written where a record has them.
ACCESS_FIELDS = ("request_id", "method", "path", "status", "model", "prompt_tokens", "completion_tokens", "ttft_s",
                 "duration_s", "finish_reason", "cancelled")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: timestamp (UTC, ISO 8601), level, logger, message, the request id and the
    access fields a record carries, and a bounded traceback under `exception`."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"timestamp": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
                "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for name in ACCESS_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info and record.exc_info[1] is not None:
            line["exception"] = bounded_traceback(record.exc_info[1])
        return json.dumps(line, ensure_ascii=True, default=str)  # ASCII: U+2028 would split a line for some readers
