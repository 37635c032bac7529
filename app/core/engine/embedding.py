"""The embedding engine: one worker thread owns a pooling model and runs every batch; the event loop never does.

A request is a list of token-id rows. Requests wait in one queue; the worker takes rows from the front, across
requests, until the next row would push the padded batch (rows x longest row) past `tokens_per_batch`, runs that
one padded pass, and hands each request its vectors once all its rows are done. So concurrent small requests
share a pass, and one large request is split into passes that other requests' rows can join behind it.

Padding changes no vector (app/models/pooling.py), so which rows share a pass is invisible in the results.
Backpressure as in the chat engine: past `max_requests` waiting, `embed` raises `Overloaded` at once.

One input can never fail its neighbours: a pass that raises is run again in two halves, down to single rows, so
only the rows that fail on their own fail, and only their requests (the chat engine retries an out-of-memory pass
the same way, app/core/engine/step.py). Deadlines as in the chat engine (app/deadlines.py): a request with rows
still waiting when its queue deadline or its whole deadline passes ends with `QueueTimeout` (a 503 with
Retry-After) and its waiting rows never run; checked before every pass, so at most one pass late. Once its last
row is in a pass it completes: a pass is never interrupted, and a request has no partial answer to give.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from app.core.engine.faults import is_out_of_memory, release_cached_memory
from app.core.engine.handle import EngineDead
from app.errors import Overloaded, QueueTimeout, ServeError, ShuttingDown

log = logging.getLogger("app.core.engine.embedding")
DEFAULT_TOKENS_PER_BATCH = 16384  # padded tokens per pass: batch 32 at 512 tokens, or 256 short sentences


class EmbeddingFailed(ServeError):
    status = 500


@dataclass(eq=False)  # compared by identity: its vectors are tensors
class EmbeddingJob:
    rows: list[list[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    queue_deadline: float | None = None  # time.perf_counter(); None: no limit (app/deadlines.py)
    deadline: float | None = None
    vectors: list[Any] = field(default_factory=list)  # filled in row order
    next_row: int = 0  # rows before this one are taken by a pass
    background: bool = False  # a batch line: queued behind every interactive request not yet started
    failed: bool = False  # one of its rows failed alone (set by the worker): its other rows are not run
    submitted_at: float = field(default_factory=time.perf_counter)

    @property
    def gone(self) -> bool:
        return self.failed or self.future.done()  # done: the client left; its remaining rows are skipped

    def late(self, now: float) -> bool:
        return any(t is not None and now >= t for t in (self.queue_deadline, self.deadline))


class EmbeddingEngine:
    """`model` is a PoolingModel or a function that loads one in the worker thread (as the chat Engine does, for
    the same reason: torch's thread pool runs faster in the thread that first used it)."""

    def __init__(self, model: Any | Callable[[], Any], max_requests: int = 64,
                 tokens_per_batch: int = DEFAULT_TOKENS_PER_BATCH, metrics: Any = None):
        self._load = model if callable(model) else (lambda: model)
        self.lm = None
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self.died: BaseException | None = None
        self.draining = False
        self.max_requests = max_requests
        self.tokens_per_batch = tokens_per_batch
        self.passes = 0  # batches run, for tests and the log
        self.step_started_at = self.step_ended_at = 0.0  # the last pass's, time.monotonic()
        self.metrics = metrics  # its queue_depth gauge: what the k8s HPA scales on, for this engine too
        self._queue: deque[EmbeddingJob] = deque()
        self._running = 0  # requests whose rows are in the pass now running
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="embedding-engine", daemon=True)

    # ---- called from the event loop ----

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        if self.died is not None or self.load_error is not None or self._stopping:
            return False
        return self._thread.is_alive() or not self._thread.ident

    @property
    def in_flight(self) -> int:
        with self._wake:
            return len(self._queue) + self._running

    def abort_all(self, err: ServeError) -> None:
        with self._wake:
            jobs, self._queue = list(self._queue), deque()
        for job in jobs:
            self._settle(job, err)

    async def embed(self, rows: list[list[int]], deadlines: tuple[float | None, float | None] = (None, None),
                    background: bool = False) -> list[torch.Tensor]:
        """One vector (float32, on the CPU) per row, in order. `deadlines`: (queue deadline, whole deadline), as
        app/deadlines.py's request_deadlines gives them. `background`: a batch line, the chat engine's class of the
        same name: it waits behind interactive requests and counts against its own `max_requests`."""
        if self.draining:
            raise ShuttingDown()
        loop = asyncio.get_running_loop()
        job = EmbeddingJob(rows, loop, loop.create_future(), *deadlines, background=background)
        with self._wake:
            if self.died is not None or self._stopping:
                raise EngineDead("the embedding engine has stopped")
            if sum(j.background == background for j in self._queue) >= self.max_requests:
                raise Overloaded(f"server is at capacity ({self.max_requests} embedding requests queued); "
                                 "retry shortly")
            # an interactive request goes ahead of the background ones not yet started (a started one keeps its place:
            # its rows are split across passes in order)
            at = len(self._queue) if background else next(
                (i for i, j in enumerate(self._queue) if j.background and j.next_row == 0), len(self._queue))
            self._queue.insert(at, job)
            self._show_queue()
            self._wake.notify()
        return await job.future

    # ---- the worker thread ----

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        try:
            self.lm = self._load()
        except BaseException as err:  # noqa: BLE001 - reported to whoever waits on `loaded`
            self.load_error = err
            return
        finally:
            self.loaded.set()
        try:
            while (batch := self._next_batch()) is not None:
                self._run_pass(batch)
                self.step_ended_at = time.monotonic()
        except BaseException as err:  # noqa: BLE001 - a bug in the loop: nobody may be left waiting
            log.exception("the embedding engine thread died")
            self.died = err
        self.abort_all(EngineDead("the embedding engine stopped") if self.died else ShuttingDown("the engine stopped"))

    def _next_batch(self) -> list[tuple[EmbeddingJob, list[int]]] | None:
        """Rows from the front of the queue while the padded batch stays within budget (always at least one)."""
        with self._wake:
            while True:
                self._expire()
                self._prune()
                if self._stopping:
                    return None
                if self._queue:
                    break
                self._wake.wait()
            batch, width = [], 0
            for job in self._queue:
                while job.next_row < len(job.rows):
                    row = job.rows[job.next_row]
                    wider = max(width, len(row))
                    if batch and wider * (len(batch) + 1) > self.tokens_per_batch:
                        break
                    batch.append((job, row))
                    width, job.next_row = wider, job.next_row + 1
                if job.next_row < len(job.rows):
                    break  # the budget is spent; keep order: no later request's rows jump ahead
            self._prune()  # the requests fully taken: their vectors come from this pass
            self._show_queue()
            self._running = len({id(job) for job, _ in batch})
            return batch

    def _show_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._queue))

    def _expire(self) -> None:
        """End the requests with rows still waiting whose deadlines have passed (call with the lock held)."""
        now = time.perf_counter()
        for job in [job for job in self._queue if not job.gone and job.late(now)]:
            job.failed = True  # rows of it already in a pass give nothing: it has no partial answer
            if self.metrics is not None:
                self.metrics.deadlines_exceeded.labels("queue").inc()
            self._settle(job, QueueTimeout(f"the request waited {now - job.submitted_at:.1f} s for the embedding "
                                           "engine, past its limit, and was not run; retry shortly or on "
                                           "another replica"))

    def _prune(self) -> None:
        """Keep only requests with rows left to take and a client still waiting (call with the lock held)."""
        if any(job.gone or job.next_row == len(job.rows) for job in self._queue):
            self._queue = deque(job for job in self._queue if not job.gone and job.next_row < len(job.rows))

    def _run_pass(self, batch: list[tuple[EmbeddingJob, list[int]]]) -> None:
        jobs = list({id(job): job for job, _ in batch}.values())
        self.step_started_at = time.monotonic()  # /health/generate reads these, as it does the chat engine's
        results = self._embed_rows([row for _, row in batch])
        self.passes += 1
        failures: dict[int, tuple[EmbeddingJob, Exception]] = {}
        for (job, _), result in zip(batch, results):
            if job.gone:
                continue
            if isinstance(result, Exception):
                job.failed = True
                failures[id(job)] = (job, result)
            else:
                job.vectors.append(result)
        with self._wake:
            for job, _ in failures.values():
                if job in self._queue:
                    self._queue.remove(job)  # its rows not yet taken never run
            self._running = 0
        for job, err in failures.values():
            self._settle(job, EmbeddingFailed(f"embedding this input failed: {type(err).__name__}: {err}"))
        for job in jobs:
            if not job.failed and len(job.vectors) == len(job.rows):
                self._settle(job, job.vectors)

    def _embed_rows(self, rows: list[list[int]]) -> list[torch.Tensor | Exception]:
        """Each row's vector, or the error it fails with alone: a pass that raises is run again in two halves,
        down to single rows, so rows that would succeed on their own do (an input the model cannot take, or one
        too large for the memory left, fails only itself). Halves, not row by row: one bad row among 32 costs 10
        more passes instead of 32."""
        try:
            return list(self.lm.embed(rows))  # [rows, H]
        except Exception as err:  # noqa: BLE001 - fails only the rows that fail alone; the engine keeps serving
            if len(rows) == 1:
                log.exception("an embedding input of %d tokens failed", len(rows[0]))
                return [err]
            log.warning("an embedding pass of %d rows failed (%s: %s); running it again in halves", len(rows),
                        type(err).__name__, err)
            if is_out_of_memory(err):
                release_cached_memory(self.lm.device)
            half = (len(rows) + 1) // 2
            return self._embed_rows(rows[:half]) + self._embed_rows(rows[half:])

    @staticmethod
    def _settle(job: EmbeddingJob, result) -> None:
        def settle():
            if job.future.done():
                return
            if isinstance(result, BaseException):
                job.future.set_exception(result)
            else:
                job.future.set_result(result)
        try:
            job.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass
