"""`python -m app batch INPUT.jsonl -o OUTPUT.jsonl`: a batch file run offline, through the same serving layer
(app/entry.py) as the server's Batches API, with a progress bar on a terminal and plain progress lines elsewhere.

Each answer is appended to OUTPUT as one line, in the Batches API's output shape, written whole and flushed as soon
as its line finishes: after Ctrl-C (or a crash), `--resume` skips every custom_id already answered in OUTPUT, so no
line runs twice and none is missing. Lines that got an error of their own (a 4xx) are in OUTPUT too, with their
status code (as vLLM's run-batch writes them), and the summary counts them; a 429, 503 or 500 is not the line's
answer: it is run again (a 500 at most MAX_ATTEMPTS times), and `--resume` runs again any such line an older
OUTPUT holds.

It is not a server: the server's API_KEY and BATCH_DIR (often exported for `serve`) are not its settings. Its lines
run as the machine's own user would, with no key and every priority allowed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path

from app.batch.lines import BadInput, Line, check_file, iter_lines, output_record_json
from app.batch.runner import MAX_ATTEMPTS, RETRY_S
from app.entry import Answer, Caller, call
from app.progress import bar, note

PLAIN_EVERY_S = 5.0  # without a terminal, a progress line this often


class Progress:
    """done / total, tokens per second and time left: a tqdm bar on a terminal, else a line every PLAIN_EVERY_S."""

    def __init__(self, total: int, done: int):
        self.total, self.done, self.failed, self.tokens = total, done, 0, 0
        self.started = time.monotonic()
        self.fresh = 0  # lines run by this process (the rate counts only those)
        self.bar = bar(total=total, initial=done, unit="line", desc="batch")
        self.last_note = self.started

    def add(self, ok: bool, tokens: int) -> None:
        self.done, self.fresh, self.tokens = self.done + 1, self.fresh + 1, self.tokens + tokens
        self.failed += not ok
        rate = self.tokens / max(time.monotonic() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{rate:.1f} tok/s, {self.failed} failed", refresh=False)
        self.bar.update(1)
        now = time.monotonic()
        if self.bar.disable and (now - self.last_note >= PLAIN_EVERY_S or self.done == self.total):
            self.last_note = now
            note(f"batch: {self.done}/{self.total} lines, {rate:.1f} tok/s, {self.left()} left")

    def left(self) -> str:
        if not self.fresh:
            return "?"
        per_line = (time.monotonic() - self.started) / self.fresh
        return f"~{per_line * (self.total - self.done):.0f} s"

    def close(self) -> None:
        self.bar.close()


def done_custom_ids(output: Path) -> set[str]:
    """custom_ids already answered in OUTPUT. A torn last line (a kill mid-write) is cut off, and lines that hold a
    retryable error (a 429, 503 or 500 from an older version of this command) are dropped, so both run again."""
    kept, ids, dropped = bytearray(), set(), False
    with open(output, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                dropped = True  # torn
                continue
            try:
                record = json.loads(raw)
                custom_id, status = record["custom_id"], (record.get("response") or {}).get("status_code")
            except (ValueError, KeyError, TypeError, AttributeError):
                raise BadInput(f"OUTPUT line {number} is not an output line of this command; cannot resume") from None
            if isinstance(status, int) and not Answer(status, b"", "").final:
                dropped = True
                continue
            ids.add(custom_id)
            kept += raw
    if dropped:  # rewritten whole, then renamed: a kill now leaves the old file or the new, never half of one
        tmp = output.with_name(output.name + ".resume")
        tmp.write_bytes(bytes(kept))
        os.replace(tmp, output)
    return ids


def run_batch(input_path: Path, output_path: Path, resume: bool, settings) -> int:
    # the server's settings that an offline run must not take from the environment (see the module docstring)
    settings = settings.model_copy(update={"api_key": None, "batch_dir": None, "priority_keys": "*"})
    try:
        _, total = check_file(input_path, None, settings.batch_max_lines)
    except OSError as err:
        print(f"error: INPUT {input_path}: {err.strerror or err}", file=sys.stderr)
        return 2
    except BadInput as err:
        print(f"error: INPUT {input_path}: {err}", file=sys.stderr)
        return 2
    if output_path.exists() and not resume:
        print(f"error: OUTPUT {output_path} exists: pass --resume to continue it, or remove it", file=sys.stderr)
        return 2
    try:
        done = done_custom_ids(output_path) if output_path.exists() else set()
    except BadInput as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    progress = Progress(total, len(done))
    try:
        asyncio.run(run_lines(input_path, done, output_path, settings, progress))
    except KeyboardInterrupt:
        progress.close()
        print(f"\ninterrupted: {progress.done} of {total} lines are in {output_path}; run again with --resume "
              "to finish", file=sys.stderr)
        return 130
    progress.close()
    took = time.monotonic() - progress.started
    print(f"done: {progress.done} lines in {output_path} ({progress.fresh} this run, {progress.failed} failed), "
          f"{progress.tokens} tokens generated in {took:.1f} s", file=sys.stderr)
    return 1 if progress.failed else 0


async def run_lines(input_path: Path, done: set[str], output_path: Path, settings, progress: Progress) -> None:
    from app.main import create_app

    app = create_app(settings)
    state = app.state.serve
    async with app.router.lifespan_context(app):
        while not state.ready:  # the model loads in the lifespan's task
            if state.load_error:
                raise SystemExit(f"error: the model failed to load: {state.load_error}")
            await asyncio.sleep(0.05)
        slots = asyncio.Semaphore(settings.max_active)  # offline, the whole engine is the batch's
        lines = iter_lines(input_path, None)
        with open(output_path, "ab") as out:
            async def run(line: Line) -> None:
                try:
                    answer = await answer_of(state, line)
                    record = output_record_json(line, answer.status, answer.body, answer.request_id)
                    out.write((record + "\n").encode())  # one write: whole or torn
                    out.flush()
                finally:
                    slots.release()
                ok = 200 <= answer.status < 300
                usage = json.loads(answer.body).get("usage") if ok and answer.body[:1] == b"{" else None
                progress.add(ok, (usage or {}).get("completion_tokens", 0) or 0)

            running: set[asyncio.Task] = set()
            while True:  # the input read a line at a time, as slots free up: memory does not grow with its size
                await slots.acquire()
                line = await asyncio.to_thread(next, lines, None)
                while line is not None and line.custom_id in done:
                    line = await asyncio.to_thread(next, lines, None)
                if line is None:
                    break
                task = asyncio.create_task(run(line))
                running.add(task)
                task.add_done_callback(running.discard)
            if running:
                await asyncio.gather(*running)
    logging.getLogger("app").info("batch finished")


async def answer_of(state, line: Line) -> Answer:
    """A line's final answer: a 429 or 503 is run again after a pause, a 500 at most MAX_ATTEMPTS times."""
    pause, failures = RETRY_S[0], 0
    while True:
        answer = await call(state, line.url, line.body, Caller(name="batch"))
        failures += answer.status >= 500 and answer.status != 503
        if answer.final or failures >= MAX_ATTEMPTS:
            return answer
        await asyncio.sleep(pause)
        pause = min(pause * 2, RETRY_S[1])
