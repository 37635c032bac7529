"""The batch runner: runs every unfinished batch's remaining lines through the serving layer (app/entry.py).

How a batch yields: at most BATCH_CONCURRENCY lines are in the engine at once, across all batches, each in the
engine's background class (app/core/engine/engine.py): they wait behind every interactive request and run in the
slots users leave free, plus BATCH_SLOTS of their own, so steady interactive traffic slows a batch but never stops it.
A line already decoding is not preempted: on a CPU a preempted line would recompute its prompt.

A line's answer is stored only when it is final (app/entry.py `Answer.final`): a 2xx, or a 4xx the line itself
caused. A 429 or a 503 (a full queue, an engine restarting) is run again after a pause, for as long as the batch's
window lasts; another 5xx (a bug) at most MAX_ATTEMPTS times. While the server drains (SIGTERM) no line starts, and
a line answered 503 by the drain is left without a row: the next process runs it. So a restart loses no line.

Streams: the input file is read a line at a time when the line is due (on a thread, skipping the lines already
answered), and answers are committed in groups (`ResultWriter`, one fsync per group), never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import Awaitable, Callable, Iterator

from app.batch.lines import BadInput, Line, check_file, error_record, iter_lines, output_record_json
from app.batch.store import Store
from app.entry import Answer, Caller

log = logging.getLogger("app.batch")
Serve = Callable[[str, dict, Caller], Awaitable[Answer]]
WINDOW = re.compile(r"^(\d{1,7})([smhd])$")
SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW_S = 365 * 86400  # a window past a year is a typo, and must stay within SQLite's INTEGER
MAX_ATTEMPTS = 3  # a line answered 500 (a bug, not a busy server) is run this many times, then its error is kept
RETRY_S = (0.5, 30.0)  # the pause before running a line again: from the first, doubling, up to the second
CANCEL_WAIT_S = 2.0  # how long a cancel waits for the lines in flight to let go of their slots


def window_seconds(window: str) -> int | None:
    """`24h` (OpenAI's only value), or any `<n>s|m|h|d` up to a year; None when malformed or out of range."""
    match = WINDOW.match(window)
    seconds = int(match[1]) * SECONDS[match[2]] if match else 0
    return seconds if 0 < seconds <= MAX_WINDOW_S else None


class ResultWriter:
    """Group commit: lines that finish while a commit runs go into the next one, in a thread."""

    def __init__(self, store: Store):
        self.store = store
        self._pending: list[tuple[tuple, asyncio.Future]] = []
        self.flushing: asyncio.Task | None = None

    async def add(self, batch_id: str, line: Line, ok: bool, record: str) -> None:
        done = asyncio.get_running_loop().create_future()
        self._pending.append(((batch_id, line.number, line.custom_id, ok, record), done))
        if self.flushing is None or self.flushing.done():
            self.flushing = asyncio.create_task(self._flush())
        await asyncio.shield(done)  # a line cancelled now still has its row written

    async def _flush(self) -> None:
        while self._pending:
            group, self._pending = self._pending, []
            try:
                await asyncio.to_thread(self.store.add_results, [row for row, _ in group])
            except Exception as err:  # noqa: BLE001 - each waiting line sees the failure
                for _, done in group:
                    done.set_exception(err)
            else:
                for _, done in group:
                    done.set_result(None)


class BatchRunner:
    def __init__(self, store: Store, serve: Serve, concurrency: int, max_lines: int,
                 caller_of: Callable[[str], Caller | None] = lambda owner: Caller(background=True),
                 draining: Callable[[], bool] = lambda: False, on_line: Callable[[bool], None] = lambda ok: None):
        self.store, self.serve, self.max_lines = store, serve, max_lines
        self.caller_of = caller_of  # a batch owner -> who its lines run as (None: the owner's key is gone)
        self.draining = draining  # SIGTERM: no new line starts
        self.on_line = on_line  # metrics: a line finished, ok or not
        self.writer = ResultWriter(store)
        self._slots = asyncio.Semaphore(concurrency)
        self._loop = asyncio.get_running_loop()  # made on the server's loop, where its batches run
        self._tasks: dict[str, asyncio.Task] = {}
        self._lines: dict[str, set[asyncio.Task]] = {}  # each batch's lines in flight
        self._tidy: asyncio.Task | None = None

    def resume_all(self) -> None:
        """At start: every batch a previous process left unfinished runs on from where it stopped."""
        for batch in self.store.unfinished():
            log.info("resuming batch %s (%s)", batch["id"], batch["status"])
            self.start(batch["id"])

    def start(self, batch_id: str) -> None:
        """Run a batch (from any thread: the routes check a new batch's file in one)."""
        if asyncio._get_running_loop() is not self._loop:
            self._loop.call_soon_threadsafe(self.start, batch_id)
            return
        if batch_id not in self._tasks:
            task = asyncio.create_task(self._run(batch_id))
            self._tasks[batch_id] = task
            task.add_done_callback(lambda _: self._tasks.pop(batch_id, None))

    def cancel(self, batch_id: str) -> None:
        """After the batch was marked `cancelling`: its lines in flight stop now (no row: they did not finish)."""
        if asyncio._get_running_loop() is not self._loop:
            self._loop.call_soon_threadsafe(self.cancel, batch_id)
            return
        for task in self._lines.get(batch_id, ()):
            task.cancel()
        self.start(batch_id)  # a batch with no runner (none should be) still reaches `cancelled`

    def tidy(self, retention_s: float, every_s: float = 3600) -> None:
        """Retention: files and finished batches older than `retention_s` are deleted now and every `every_s`."""
        async def loop() -> None:
            while True:
                await asyncio.to_thread(self.store.forget_before, int(time.time() - retention_s))
                await asyncio.sleep(every_s)
        self._tidy = asyncio.create_task(loop())

    async def stop(self) -> None:
        """At shutdown: lines in flight are abandoned (no row: the next start runs them again)."""
        if self._tidy is not None:
            self._tidy.cancel()
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self.writer.flushing is not None:  # the answers already in hand are committed before the store closes
            await asyncio.gather(self.writer.flushing, return_exceptions=True)

    async def wait(self, batch_id: str) -> None:
        if task := self._tasks.get(batch_id):
            await asyncio.shield(task)

    async def _run(self, batch_id: str) -> None:
        try:
            await self._run_batch(batch_id)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - a batch fails alone, naming why; the server goes on
            log.exception("batch %s failed", batch_id)
            message = str(err) if isinstance(err, (BadInput, OSError)) else f"{type(err).__name__}: {err}"
            await asyncio.to_thread(self.store.set_status, batch_id, "failed",
                                    errors=errors_json("batch_failed", message))

    async def _run_batch(self, batch_id: str) -> None:
        batch = self.store.batch(batch_id)
        path = self.store.file_path(batch["input_file_id"])
        if batch["status"] in ("validating", "in_progress") and not path.exists():
            raise BadInput(f"the input file {batch['input_file_id']} is gone")  # its id, never a server path
        if batch["status"] == "validating":
            await asyncio.to_thread(check_file, path, batch["endpoint"], self.max_lines)
            self.store.set_status(batch_id, "in_progress", only_from=("validating",))
        if batch["status"] in ("validating", "in_progress"):
            await self._run_lines(batch, path)
        await self._finish(self.store.batch(batch_id), path)

    async def _run_lines(self, batch: dict, path) -> None:
        done = await asyncio.to_thread(self.store.done_lines, batch["id"])
        lines = iter_lines(path, batch["endpoint"], skip=done)
        caller = self.caller_of(batch["owner"])
        running = self._lines.setdefault(batch["id"], set())
        try:
            while True:
                await self._slots.acquire()
                line = None if self._stopped(batch["id"]) else await asyncio.to_thread(next_line, lines)
                if line is None:
                    self._slots.release()
                    break
                task = asyncio.create_task(self._run_line(batch, line, caller))
                task.add_done_callback(lambda _: self._slots.release())
                running.add(task)
                task.add_done_callback(running.discard)
            if running:
                await asyncio.wait(list(running))
        finally:
            for task in running:
                task.cancel()  # cancelled or shutting down: the lines in flight end with no row, to run again
            self._lines.pop(batch["id"], None)
            lines.close()

    def _stopped(self, batch_id: str) -> bool:
        """Cancelled, past its completion window, or the server is draining: no new line starts."""
        if self.draining():
            return True
        batch = self.store.batch(batch_id)
        if batch["status"] != "in_progress":
            return True
        return batch["expires_at"] is not None and time.time() >= batch["expires_at"]

    async def _run_line(self, batch: dict, line: Line, caller: Caller | None) -> None:
        if caller is None:  # its owner's key is no longer configured: the answer any unknown key gets
            record = json.dumps(error_record(line, "invalid_api_key", "the API key that created this batch is no "
                                             "longer configured on this server"), ensure_ascii=False)
            await self.writer.add(batch["id"], line, False, record)
            self.on_line(False)
            return
        failures, pause = 0, RETRY_S[0]
        while True:
            answer = await self.serve(line.url, line.body, caller.again())
            failures += answer.status >= 500 and answer.status != 503
            if answer.final or failures >= MAX_ATTEMPTS:
                break
            if self.draining() or self._stopped(batch["id"]):
                return  # no row: the next process (or nobody, once the batch is over) runs it
            log.info("batch %s line %d: %d, run again in %.1f s", batch["id"], line.number, answer.status, pause)
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_S[1])
        ok = 200 <= answer.status < 300
        record = await asyncio.to_thread(output_record_json, line, answer.status, answer.body, answer.request_id)
        await self.writer.add(batch["id"], line, ok, record)
        self.on_line(ok)

    async def _finish(self, batch: dict, path) -> None:
        status = batch["status"]
        if status == "in_progress" and self.draining():
            return  # the next process goes on with it
        if status == "in_progress" and batch["expires_at"] is not None and time.time() >= batch["expires_at"]:
            await asyncio.to_thread(self._expire_rest, batch, path)
            final = "expired"
        elif status == "cancelling":
            final = "cancelled"
        elif status in ("in_progress", "finalizing"):
            self.store.set_status(batch["id"], "finalizing", only_from=("in_progress", "finalizing"))
            final = "completed"
        else:
            return
        try:
            output_id, error_id = await asyncio.to_thread(self.store.write_outputs, batch)
        except OSError as err:  # disk full, say: the batch fails naming it, no partial output file is presented
            self.store.set_status(batch["id"], "failed", errors=errors_json(
                "output_write_failed", f"writing the output file failed: {err.strerror or err}"))
            return
        self.store.set_status(batch["id"], final, output_file_id=output_id, error_file_id=error_id)
        log.info("batch %s %s", batch["id"], final)

    def _expire_rest(self, batch: dict, path) -> None:
        """OpenAI's: the lines that did not run are in the error file as batch_expired (in a thread)."""
        done = self.store.done_lines(batch["id"])
        rows = [(batch["id"], line.number, line.custom_id, False, json.dumps(error_record(
            line, "batch_expired", "the batch's completion_window ended before this request ran"),
            ensure_ascii=False)) for line in iter_lines(path, batch["endpoint"], skip=done)]
        if rows:
            self.store.add_results(rows)


def next_line(lines: Iterator[Line]) -> Line | None:
    return next(lines, None)


def errors_json(code: str, message: str, line: int | None = None) -> str:
    return json.dumps({"object": "list", "data": [{"code": code, "message": message, "param": None, "line": line}]})
