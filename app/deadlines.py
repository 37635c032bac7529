"""A request's two deadlines, from the server's settings and the client's `x-request-timeout` header.

- The queue deadline (QUEUE_TIMEOUT_S after the request was submitted): a request still waiting for a decode slot
  then ends with a 503 and `Retry-After`, and never starts.
- The whole deadline (REQUEST_TIMEOUT_S after the request arrived, or `x-request-timeout` if that is sooner): a
  generation still running then ends at that engine step with finish reason "timeout" (a request still queued
  ends as above). The header can only shorten the server's limit: a client cannot buy itself more time.

Both are `time.perf_counter()` times, the clock the engine's handles keep (app/core/engine/handle.py).
"""

from __future__ import annotations

import math
import time

from app.errors import InvalidRequest

HEADER = "x-request-timeout"


def header_timeout(value: str | None) -> float | None:
    """The header's seconds; a 400 naming the header for anything but a positive finite number."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidRequest(f"{HEADER} must be a positive number of seconds, got {value[:40]!r}", param=HEADER,
                             code="invalid_value")
    return seconds


def request_deadlines(header: str | None, arrived: float | None, queue_timeout_s: float | None,
                      request_timeout_s: float | None) -> tuple[float | None, float | None]:
    """(queue deadline, whole deadline) for a request submitted now that arrived at `arrived`; None: no limit."""
    now = time.perf_counter()
    arrived = now if arrived is None else arrived
    limits = [t for t in (request_timeout_s, header_timeout(header)) if t is not None]
    deadline = arrived + min(limits) if limits else None
    queue_deadline = now + queue_timeout_s if queue_timeout_s is not None else None
    return queue_deadline, deadline
