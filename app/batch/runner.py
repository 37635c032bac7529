"""The batch runner: runs every unfinished batch's remaining lines in the capacity interactive users leave idle.

How a batch yields (the choice, and why): batch lines run at most BATCH_CONCURRENCY at a time across all batches,
and a line starts only while no interactive request is in flight; the engine also orders its waiting queue by
`priority` (lower first), and batch lines carry BATCH_PRIORITY, so an interactive request that arrives while a line
waits for a slot goes first. A line already decoding is not preempted: on a CPU a preempted line would recompute its
prompt, and a line is short next to a batch, so at most BATCH_CONCURRENCY lines' steps are shared with an
interactive request, and only until those lines end.

Restart safety: each finished line is a row in the store, committed once; the runner of a new process skips the
lines that have one. Expiry (`completion_window`) and cancelling are checked between lines.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import Any, Awaitable, Callable

from app.batch.lines import Line, error_record, output_record, read_lines
from app.batch.store import Store

log = logging.getLogger("app.batch")
Dispatch = Callable[[str, dict[str, Any], str | None], Awaitable[tuple[int, Any, str]]]
WINDOW = re.compile(r"^(\d+)([smhd])$")
SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
IDLE_POLL_S = 0.05  # how often a waiting batch looks again for idle capacity


def window_seconds(window: str) -> int | None:
    """`24h` (OpenAI's only value), or any `<n>s|m|h|d`; None when malformed."""
    match = WINDOW.match(window)
    return int(match[1]) * SECONDS[match[2]] if match and int(match[1]) > 0 else None


class BatchRunner:
    def __init__(self, store: Store, dispatch: Dispatch, concurrency: int, priority: int, max_lines: int,
                 interactive_busy: Callable[[], bool] = lambda: False, tenant_of: Callable[[str], str | None] =
                 lambda owner: None, on_line: Callable[[bool], None] = lambda ok: None):
        self.store, self.dispatch = store, dispatch
        self.priority, self.max_lines = priority, max_lines
        self.interactive_busy = interactive_busy  # True while an interactive request is in flight
        self.tenant_of = tenant_of  # a batch owner -> the tenant its lines run as (None: the owner's key is gone)
        self.on_line = on_line  # metrics: a line finished, ok or not
        self._slots = asyncio.Semaphore(concurrency)
        self._loop = asyncio.get_running_loop()  # made on the server's loop, where its batches run
        self._tasks: dict[str, asyncio.Task] = {}
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
            self.store.set_status(batch_id, "failed", errors=errors_json("batch_failed", f"{type(err).__name__}: {err}"))

    async def _run_batch(self, batch_id: str) -> None:
        batch = self.store.batch(batch_id)
        lines = read_lines(self.store.file_path(batch["input_file_id"]).read_bytes(), batch["endpoint"],
                           self.max_lines)
        if batch["status"] == "validating":
            self.store.set_status(batch_id, "in_progress", only_from=("validating",))
        if batch["status"] in ("validating", "in_progress"):
            await self._run_lines(batch, lines)
        self._finish(self.store.batch(batch_id), lines)

    async def _run_lines(self, batch: dict, lines: list[Line]) -> None:
        done = self.store.done_lines(batch["id"])
        tenant = self.tenant_of(batch["owner"])
        running: set[asyncio.Task] = set()
        try:
            for line in (l for l in lines if l.number not in done):
                await self._slots.acquire()
                while self.interactive_busy() and not self._stopped(batch["id"]):
                    await asyncio.sleep(IDLE_POLL_S)  # yield: interactive requests come first
                if self._stopped(batch["id"]):
                    self._slots.release()
                    break
                task = asyncio.create_task(self._run_line(batch["id"], line, tenant))
                task.add_done_callback(lambda _: self._slots.release())
                running.add(task)
                task.add_done_callback(running.discard)
            if running:
                await asyncio.gather(*running)
        finally:
            for task in running:
                task.cancel()  # cancelled or shutting down: the lines in flight end with no row, to run again

    def _stopped(self, batch_id: str) -> bool:
        """Cancelled, or past its completion window: no new line starts."""
        batch = self.store.batch(batch_id)
        if batch["status"] != "in_progress":
            return True
        if batch["expires_at"] is not None and time.time() >= batch["expires_at"]:
            return True
        return False

    async def _run_line(self, batch_id: str, line: Line, tenant: str | None) -> None:
        body = dict(line.body)
        if line.url in ("/v1/chat/completions", "/v1/completions"):
            # below interactive requests in the engine's queue (lower runs first); a line may ask for lower still
            body["priority"] = max(self.priority, body["priority"]) if isinstance(body.get("priority"), int) \
                else self.priority
        status, answer, request_id = await self.dispatch(line.url, body, tenant)
        self.store.add_result(batch_id, line.number, line.custom_id, status == 200,
                              output_record(line, status, answer, request_id))
        self.on_line(status == 200)

    def _finish(self, batch: dict, lines: list[Line]) -> None:
        status = batch["status"]
        if status == "in_progress" and batch["expires_at"] is not None and time.time() >= batch["expires_at"]:
            done = self.store.done_lines(batch["id"])
            for line in lines:  # OpenAI's: the lines that did not run are in the error file as batch_expired
                if line.number not in done:
                    self.store.add_result(batch["id"], line.number, line.custom_id, False, error_record(
                        line, "batch_expired", "the batch's completion_window ended before this request ran"))
            final = "expired"
        elif status == "cancelling":
            final = "cancelled"
        elif status in ("in_progress", "finalizing"):
            self.store.set_status(batch["id"], "finalizing", only_from=("in_progress", "finalizing"))
            final = "completed"
        else:
            return
        try:
            output_id, error_id = self.store.write_outputs(batch)
        except OSError as err:  # disk full, say: the batch fails naming it, no partial output file is presented
            self.store.set_status(batch["id"], "failed", errors=errors_json(
                "output_write_failed", f"writing the output file failed: {err.strerror or err}"))
            return
        self.store.set_status(batch["id"], final, output_file_id=output_id, error_file_id=error_id)
        log.info("batch %s %s", batch["id"], final)


def errors_json(code: str, message: str, line: int | None = None) -> str:
    return json.dumps({"object": "list", "data": [{"code": code, "message": message, "param": None, "line": line}]})
