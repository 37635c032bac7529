"""`python -m app batch INPUT.jsonl -o OUTPUT.jsonl`: a batch file run offline, through the same routes in-process
(dispatch.py) as the server's Batches API, with a progress bar on a terminal and plain progress lines elsewhere.

Each answer is appended to OUTPUT as one line, in the Batches API's output shape, written whole and flushed as soon
as its line finishes: after Ctrl-C (or a crash), `--resume` skips every custom_id already in OUTPUT, so no line runs
twice and none is missing. Lines that got an error are in OUTPUT too, with their status code (as vLLM's run-batch
writes them), and the summary counts them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from pathlib import Path

from app.batch.dispatch import call_route
from app.batch.lines import BadInput, Line, output_record, read_lines
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
    """custom_ids already answered in OUTPUT; a torn last line (a kill mid-write) is cut off so it runs again."""
    data = output.read_bytes()
    whole = data[:data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with open(output, "r+b") as f:
            f.truncate(len(whole))
    ids = set()
    for number, raw in enumerate(whole.decode("utf-8").splitlines(), start=1):
        try:
            ids.add(json.loads(raw)["custom_id"])
        except (ValueError, KeyError, TypeError):
            raise BadInput(f"{output}: line {number} is not an output line of this command; cannot resume") from None
    return ids


def run_batch(input_path: Path, output_path: Path, resume: bool, settings) -> int:
    try:
        lines = read_lines(input_path.read_bytes(), None, settings.batch_max_lines)
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
    pending = [line for line in lines if line.custom_id not in done]
    progress = Progress(len(lines), len(lines) - len(pending))
    try:
        asyncio.run(run_lines(pending, output_path, settings, progress))
    except KeyboardInterrupt:
        progress.close()
        print(f"\ninterrupted: {progress.done} of {len(lines)} lines are in {output_path}; run again with --resume "
              "to finish", file=sys.stderr)
        return 130
    progress.close()
    took = time.monotonic() - progress.started
    print(f"done: {progress.done} lines in {output_path} ({progress.fresh} this run, {progress.failed} failed), "
          f"{progress.tokens} tokens generated in {took:.1f} s", file=sys.stderr)
    return 1 if progress.failed else 0


async def run_lines(pending: list[Line], output_path: Path, settings, progress: Progress) -> None:
    from app.main import create_app

    app = create_app(settings)
    state = app.state.serve
    async with app.router.lifespan_context(app):
        while not state.ready:  # the model loads in the lifespan's task
            if state.load_error:
                raise SystemExit(f"error: the model failed to load: {state.load_error}")
            await asyncio.sleep(0.05)
        slots = asyncio.Semaphore(settings.max_active)  # offline, the whole engine is the batch's
        with open(output_path, "ab") as out:
            async def run(line: Line) -> None:
                async with slots:
                    status, body, request_id = await call_route(app, line.url, line.body, None)
                record = output_record(line, status, body, request_id)
                out.write((json.dumps(record, ensure_ascii=False) + "\n").encode())  # one write: whole or torn
                out.flush()
                usage = (body or {}).get("usage") if isinstance(body, dict) else None
                progress.add(status == 200, (usage or {}).get("completion_tokens", 0) or 0)

            await asyncio.gather(*(run(line) for line in pending))
    logging.getLogger("app").info("batch finished")
