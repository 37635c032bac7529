"""Each request's id: the client's `x-request-id` if it is a usable one, else ours. Every response carries it back
in `x-request-id`, the response's own `id` ends with it (`chatcmpl-<id>`, `msg_<id>`, `resp_<id>`), and every log
line written while the request is handled carries it (`RequestIdFilter`, through a context variable that the
request's tasks inherit).

A usable id is 1 to `MAX_LENGTH` printable ASCII characters without spaces: it goes into a header, a JSON id and a
log line, so nothing that could split a line or a header, and nothing a log could be flooded with. An unusable one
is replaced, not refused: an id is for finding a request afterwards, never a reason to fail it.
"""

from __future__ import annotations

import contextvars
import logging
import re
import uuid

HEADER = "x-request-id"
MAX_LENGTH = 128
_USABLE = re.compile(rb"[!-~]{1,%d}" % MAX_LENGTH)  # printable ASCII, no space

current = contextvars.ContextVar("request_id", default=None)


def request_id_from(sent: bytes | None) -> str:
    """The client's id if usable, else a new one (32 hex digits)."""
    if sent is not None and _USABLE.fullmatch(sent):
        return sent.decode("ascii")
    return uuid.uuid4().hex


class RequestIdFilter(logging.Filter):
    """Gives every record a `request_id`: the one it was logged with (`extra=`), else the request being handled
    in this task or thread, else None."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = current.get()
        return True
