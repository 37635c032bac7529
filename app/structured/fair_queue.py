"""A thread pool that serves its clients in turn, so that one client's many jobs never queue ahead of another's.

Grammar compiles (app/structured/grammars.py) run here. A plain FIFO pool let one client that sent nine costly
schemas at once hold the only worker for all of them (121 s a round) while another client's compile of a few
tens of ms waited behind: its answer took 57 s instead of 2.7 s. Here each client has its own queue, and a free
worker takes the next job of the waiting client with the fewest jobs running, and among those the one served
longest ago (a client with nothing running or waiting starts afresh, behind those already waiting). So a client
whose jobs are all waiting goes before one that has a job running: with one worker, another client's job starts
after at most the job that is running. How many a client may have waiting is its caller's bound.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from concurrent.futures import Future
from typing import Any, Callable


class FairQueue:
    def __init__(self, workers: int, name: str = "fair"):
        # client -> its jobs in order of arrival; the first client in the dict is served next
        self._waiting: OrderedDict[str, deque[tuple[Future, Callable[..., Any], tuple]]] = OrderedDict()
        self._running: dict[str, int] = {}  # client -> its jobs running
        self._served: dict[str, int] = {}  # client -> when its last job started, while it has jobs waiting or running
        self._turn = 0
        self._changed = threading.Condition()
        self._closed = False
        # daemon: a compile still running at exit must not hold the process (its worker process is killed anyway)
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, client: str, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._changed:
            if self._closed:
                raise RuntimeError("the queue is shut down")
            self._waiting.setdefault(client, deque()).append((future, fn, args))
            self._changed.notify()
        return future

    def _next(self) -> tuple[str, tuple[Future, Callable[..., Any], tuple]] | None:
        with self._changed:
            while not self._waiting and not self._closed:
                self._changed.wait()
            if self._closed:
                return None
            # min() keeps the first of equals: the waiting dict is in order of arrival
            client = min(self._waiting, key=lambda c: (self._running.get(c, 0), self._served.get(c, -1)))
            jobs = self._waiting[client]
            job = jobs.popleft()
            if not jobs:
                del self._waiting[client]
            self._running[client] = self._running.get(client, 0) + 1
            self._served[client] = self._turn
            self._turn += 1
            return client, job

    def _finished(self, client: str) -> None:
        with self._changed:
            self._running[client] -= 1
            if not self._running[client]:
                del self._running[client]
                if client not in self._waiting:  # idle: forget it, so the tables hold only clients with jobs
                    del self._served[client]

    def _serve(self) -> None:
        while (taken := self._next()) is not None:
            client, (future, fn, args) = taken
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args))
                    except BaseException as err:  # noqa: BLE001 - the caller gets whatever the job raised
                        future.set_exception(err)
            finally:
                self._finished(client)

    def shutdown(self) -> None:
        """Stop taking jobs; those still waiting are cancelled, the running ones finish on their own."""
        with self._changed:
            self._closed = True
            for jobs in self._waiting.values():
                for future, _, _ in jobs:
                    future.cancel()
            self._waiting.clear()
            self._changed.notify_all()
