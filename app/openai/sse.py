"""How every stream goes out: sse-starlette's EventSourceResponse, with keep-alive pings and a send timeout.

A client that stops reading (a stalled proxy, a paused process, a hostile client with a tiny receive window) fills
the socket buffers, and then each send waits. Without a bound, its request kept its decode slot and its KV
reservation until `max_tokens`, and its task forever. With `send_timeout`, a send (an event or a ping) that cannot
complete within `SSE_SEND_TIMEOUT_S` ends the response: the event generator is closed, which cancels its
handles as a client that left would (`simple_serve_cancellations_total`), and the engine drops them at its next
step. The connection is then closed; bytes the client never read are not its problem any more, nor ours.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.sse import SendTimeoutError

log = logging.getLogger("app.openai.sse")
SSE_PING_S = 15


class EventStream(EventSourceResponse):
    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:  # an expected end (the client stopped reading), not a server error
            log.warning("%s: the client accepted nothing for %g s; its stream is ended and its generation "
                        "cancelled", scope.get("path"), self.send_timeout)


def event_stream(events: AsyncIterator[dict[str, Any]], headers: dict[str, str],
                 send_timeout_s: float | None) -> EventStream:
    headers = {**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return EventStream(events, ping=SSE_PING_S, headers=headers, send_timeout=send_timeout_s)


def encoded_event(data: str) -> bytes:
    """An SSE `data:` event as the response would write it: for a large event, made off the loop (the response
    sends bytes as they are, where a dict's text would be split into lines and encoded on the loop)."""
    return ServerSentEvent(data=data, sep=EventStream.DEFAULT_SEPARATOR).encode()
