"""The stage before the engine: parsing and validating a body, building its prompt, tokenizing it. Bounded, off the loop.

That work is CPU in Python (json, pydantic, Jinja, the tokenizer's bindings) and holds the GIL; on the event loop it
stalls every probe and stream, and in the default thread pool (6 threads on 2 cores) two dozen 1 MiB bodies took
the GIL from the loop for seconds. So it runs on a pool of its own with few workers (`PREPARE_WORKERS`), and the
requests in it, queued or running, are counted: past `MAX_PREPARING` a request gets a 429 with `Retry-After` at
once, before any of its work starts. A job that is still queued when its client disconnects never starts; one that
runs finishes (a thread cannot be stopped) and frees its slot then, so the count is always the work really pending.

The client's disconnect check comes from `client_left`, which the HTTP layer sets per request (app/api.py): the
serving code that tokenizes need not carry the request around.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any, Awaitable, Callable, TypeVar

from app.errors import Overloaded, ServeError

T = TypeVar("T")
POLL_S = 0.2  # how often a waiting request checks whether its client is still there
client_left: ContextVar[Callable[[], Awaitable[bool]] | None] = ContextVar("client_left", default=None)


class ClientGone(ServeError):
    """The client disconnected before its request reached the engine; nobody reads this answer (nginx's 499)."""

    status = 499
    error_type = "invalid_request_error"

    def __init__(self) -> None:
        super().__init__("the client closed the connection before the request was prepared", code="client_gone")


class Preparing:
    def __init__(self, limit: int = 16, workers: int = 2):
        self.limit = limit
        self.pending = 0  # jobs queued or running; changed on the event loop only
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="prepare")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a prepare worker; a 429 when `limit` jobs are already pending."""
        if self.pending >= self.limit:
            raise Overloaded(f"{self.pending} requests are being parsed or tokenized, the most this server takes "
                             "at once (MAX_PREPARING); retry shortly")
        loop = asyncio.get_running_loop()
        self.pending += 1
        job = self.executor.submit(fn, *args)
        job.add_done_callback(lambda _: self._finished_from(loop))  # run, failed or cancelled
        waiter = asyncio.wrap_future(job)
        left = client_left.get()
        try:
            while True:
                done, _ = await asyncio.wait([waiter], timeout=POLL_S)
                if done:
                    return waiter.result()
                if left is not None and await left():
                    raise ClientGone()
        finally:
            waiter.cancel()  # no-op when done; else a queued job never starts (a running one cannot be stopped)

    def _finished_from(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.call_soon_threadsafe(self._finished)
        except RuntimeError:  # the loop closed while the job ran (shutdown): nobody counts any more
            pass

    def _finished(self) -> None:
        self.pending -= 1

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
