"""Files and batches on disk: metadata in SQLite (the standard library's sqlite3, WAL mode), bodies beside it.

`BATCH_DIR/batches.sqlite3` holds three tables: `files`, `batches`, and `results`, one row per finished line, keyed
by (batch, line number), written in the same transaction that finishes the line. So a line is committed once, a
resumed batch skips exactly the lines that have a row, and the output and error files are written only at the end,
from those rows, to a temporary name renamed into place: a half-written output file is never presented as complete.

One server owns a BATCH_DIR at a time (an exclusive lock on `BATCH_DIR/lock`): two servers resuming the same batch
would run its lines twice.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import secrets
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, status TEXT NOT NULL, total INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL, in_progress_at INTEGER, expires_at INTEGER, finalizing_at INTEGER,
    completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    output_file_id TEXT, error_file_id TEXT, errors TEXT, metadata TEXT);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, ok INTEGER NOT NULL, record TEXT NOT NULL,
    PRIMARY KEY (batch_id, line));
"""
# Statuses whose batch still has work (or a decision) pending: a starting server picks these up again.
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
TIMESTAMPS = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
              "failed": "failed_at", "expired": "expired_at", "cancelling": "cancelling_at",
              "cancelled": "cancelled_at"}


class QuotaRefused(Exception):
    """A new batch would take its owner's retained requests past the quota; `used`: how many they hold now."""

    def __init__(self, used: int):
        super().__init__(used)
        self.used = used


class StoreError(Exception):
    """BATCH_DIR cannot be used: named in the message, refused at start."""


@dataclass
class Counts:
    total: int
    completed: int
    failed: int


class Store:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.files_dir = self.root / "files"
        try:
            self.files_dir.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".write-test-{os.getpid()}"
            probe.write_bytes(b"ok")
            probe.unlink()
            self._lock = open(self.root / "lock", "a+")
        except OSError as err:
            raise StoreError(f"BATCH_DIR={self.root} is not a writable directory: {err.strerror or err}") from err
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            self._lock.close()
            raise StoreError(f"BATCH_DIR={self.root} is in use by another server process; give each server its "
                             "own BATCH_DIR") from err
        # check_same_thread=False: one connection, used under self._mutex from the loop and its worker threads
        self._db = sqlite3.connect(self.root / "batches.sqlite3", check_same_thread=False, isolation_level=None)
        self._mutex = threading.Lock()
        with self._mutex:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a committed line survives a power cut, not only a kill -9
            self._db.executescript(SCHEMA)
        self.owner_secret = self._secret()
        self._remove_leftovers()

    def close(self) -> None:
        with self._mutex:
            self._db.close()
        self._lock.close()

    def _secret(self) -> bytes:
        """A key per BATCH_DIR, kept in it: owners are HMACs of API keys under it, stable across restarts."""
        path = self.root / "owner.key"
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
        return path.read_bytes()

    def _rows(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._mutex:
            cursor = self._db.execute(sql, args)
            names = [d[0] for d in cursor.description or ()]
            return [dict(zip(names, row)) for row in cursor.fetchall()]

    def _write(self, sql: str, args: tuple = ()) -> int:
        with self._mutex:
            return self._db.execute(sql, args).rowcount

    # ---- files ----

    def new_file_id(self) -> str:
        return "file-" + uuid.uuid4().hex[:24]

    def add_file(self, file_id: str, owner: str, purpose: str, filename: str, size: int,
                 expires_at: int | None = None) -> dict:
        """List an upload that was written whole (and fsynced) to `partial_path(file_id)`: renamed into place, then
        its row."""
        os.replace(self.partial_path(file_id), self.file_path(file_id))
        fsync_dir(self.files_dir)
        self._write("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (file_id, owner, purpose, filename, size, int(time.time()), expires_at))
        return self.file(file_id, owner)

    def file(self, file_id: str, owner: str) -> dict | None:
        rows = self._rows("SELECT * FROM files WHERE id = ? AND owner = ?", (file_id, owner))
        return rows[0] if rows else None

    def files(self, owner: str, purpose: str | None = None) -> list[dict]:
        if purpose is None:
            return self._rows("SELECT * FROM files WHERE owner = ? ORDER BY created_at DESC, id", (owner,))
        return self._rows("SELECT * FROM files WHERE owner = ? AND purpose = ? ORDER BY created_at DESC, id",
                          (owner, purpose))

    def delete_file(self, file_id: str, owner: str) -> bool:
        if not self._write("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)):
            return False
        self.file_path(file_id).unlink(missing_ok=True)
        return True

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.jsonl"

    def partial_path(self, file_id: str) -> Path:
        """Where a file is written before it is whole: never listed, removed at start if a crash left it."""
        return self.files_dir / f"{file_id}.partial"

    def _remove_leftovers(self) -> None:
        """At start, with BATCH_DIR locked (so nothing is being written): files a crash left half written, and
        whole ones it left unlisted (killed between the rename and the row's insert)."""
        for path in self.files_dir.glob("file-*.partial"):
            path.unlink(missing_ok=True)
        listed = {row["id"] for row in self._rows("SELECT id FROM files")}
        for path in self.files_dir.glob("file-*.jsonl"):
            if path.stem not in listed:
                path.unlink(missing_ok=True)

    # ---- quotas (service.py checks them) ----

    def usage(self, owner: str) -> tuple[int, int]:
        """(files, bytes) an owner keeps, output files included."""
        row = self._rows("SELECT COUNT(*) AS n, COALESCE(SUM(bytes), 0) AS size FROM files WHERE owner = ?",
                         (owner,))[0]
        return row["n"], row["size"]

    def result_rows(self, owner: str) -> int:
        """Requests in an owner's retained batches, finished or not: each is (or will be) a row in `results`."""
        return self._rows("SELECT COALESCE(SUM(total), 0) AS n FROM batches WHERE owner = ?", (owner,))[0]["n"]

    def _write_atomically(self, path: Path, chunks: Iterator[bytes] | list[bytes]) -> int:
        """Write to a temporary name, fsync, rename: the file is whole or absent, never half there."""
        tmp = path.with_suffix(".partial")
        size = 0
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                size += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)  # the rename itself survives a power cut
        return size

    # ---- batches ----

    def add_batch(self, owner: str, endpoint: str, input_file_id: str, completion_window: str, total: int,
                  expires_at: int, metadata: dict | None, max_in_progress: int,
                  max_result_rows: int | None = None) -> dict | None:
        """A new batch, unless its owner already has `max_in_progress` unfinished (None then) or its retained
        batches' requests would pass `max_result_rows` (QuotaRefused): counted and inserted in one transaction, so
        concurrent creates cannot pass the checks together."""
        batch_id = "batch_" + uuid.uuid4().hex[:24]
        marks = ",".join("?" * len(UNFINISHED))
        with self._mutex:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                (running,) = self._db.execute(f"SELECT COUNT(*) FROM batches WHERE owner = ? AND status IN "
                                              f"({marks})", (owner, *UNFINISHED)).fetchone()
                if running >= max_in_progress:
                    return None
                (rows,) = self._db.execute("SELECT COALESCE(SUM(total), 0) FROM batches WHERE owner = ?",
                                           (owner,)).fetchone()
                if max_result_rows is not None and rows + total > max_result_rows:
                    raise QuotaRefused(rows)
                self._db.execute("INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, "
                                 "status, total, created_at, expires_at, metadata) VALUES (?, ?, ?, ?, ?, "
                                 "'validating', ?, ?, ?, ?)",
                                 (batch_id, owner, endpoint, input_file_id, completion_window, total,
                                  int(time.time()), expires_at, json.dumps(metadata) if metadata is not None
                                  else None))
            finally:
                self._db.execute("COMMIT")
        return self.batch(batch_id)

    def batch_using(self, file_id: str) -> str | None:
        """The unfinished batch that reads `file_id` as its input, if any: such a file is kept until it ends."""
        marks = ",".join("?" * len(UNFINISHED))
        rows = self._rows(f"SELECT id FROM batches WHERE input_file_id = ? AND status IN ({marks}) LIMIT 1",
                          (file_id, *UNFINISHED))
        return rows[0]["id"] if rows else None

    def batch(self, batch_id: str, owner: str | None = None) -> dict | None:
        rows = self._rows("SELECT * FROM batches WHERE id = ?", (batch_id,))
        if not rows or (owner is not None and rows[0]["owner"] != owner):
            return None
        return rows[0]

    def batches(self, owner: str, after: str | None, limit: int) -> list[dict]:
        """Newest first, as OpenAI lists them; `after` is the last id of the previous page."""
        rows = self._rows("SELECT * FROM batches WHERE owner = ? ORDER BY created_at DESC, id DESC", (owner,))
        if after is not None:
            ids = [r["id"] for r in rows]
            rows = rows[ids.index(after) + 1:] if after in ids else []
        return rows[:limit]

    def unfinished(self) -> list[dict]:
        marks = ",".join("?" * len(UNFINISHED))
        return self._rows(f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY created_at, id", UNFINISHED)

    def count_in_progress(self, owner: str | None = None) -> int:
        marks = ",".join("?" * len(UNFINISHED))
        if owner is None:
            return self._rows(f"SELECT COUNT(*) AS n FROM batches WHERE status IN ({marks})", UNFINISHED)[0]["n"]
        return self._rows(f"SELECT COUNT(*) AS n FROM batches WHERE owner = ? AND status IN ({marks})",
                          (owner, *UNFINISHED))[0]["n"]

    def set_status(self, batch_id: str, status: str, *, only_from: tuple[str, ...] = (), **fields: Any) -> bool:
        """Move a batch to `status` (stamping its time); with `only_from`, only from one of those statuses, so a
        cancel and a finish racing each other cannot both win."""
        values = {"status": status, **fields}
        if status in TIMESTAMPS:
            values[TIMESTAMPS[status]] = int(time.time())
        sets = ", ".join(f"{k} = ?" for k in values)
        args: tuple = (*values.values(), batch_id)
        where = "id = ?"
        if only_from:
            where += f" AND status IN ({','.join('?' * len(only_from))})"
            args += only_from
        return bool(self._write(f"UPDATE batches SET {sets} WHERE {where}", args))

    # ---- results ----

    def add_results(self, rows: list[tuple[str, int, str, bool, str]]) -> None:
        """Finished lines, (batch, line, custom_id, ok, record as a JSON line), committed in one transaction: one
        fsync for all the lines that finished while the last commit ran (a line already recorded keeps its first
        result). Called from a thread: app/batch/runner.py's ResultWriter."""
        with self._mutex:
            self._db.execute("BEGIN")
            try:
                self._db.executemany("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?, ?)",
                                     [(b, n, c, int(ok), record) for b, n, c, ok, record in rows])
            finally:
                self._db.execute("COMMIT")

    def done_lines(self, batch_id: str) -> set[int]:
        return {r["line"] for r in self._rows("SELECT line FROM results WHERE batch_id = ?", (batch_id,))}

    def counts(self, batch: dict) -> Counts:
        rows = self._rows("SELECT ok, COUNT(*) AS n FROM results WHERE batch_id = ? GROUP BY ok", (batch["id"],))
        by_ok = {r["ok"]: r["n"] for r in rows}
        return Counts(batch["total"], by_ok.get(1, 0), by_ok.get(0, 0))

    def write_outputs(self, batch: dict, expires_at: int | None = None) -> tuple[str | None, str | None]:
        """The output file (lines that got a 200) and the error file (every other), in input order; each file is
        created only when it has lines, as OpenAI does. Streamed from SQLite to disk on a connection of its own
        (WAL lets it read beside the writer), never whole in memory. Each file's id is derived from the batch's, so
        a crash while finalizing, then a restart, writes the same files again instead of new ones beside them."""
        ids = []
        reader = sqlite3.connect(self.root / "batches.sqlite3")
        try:
            for ok, name in ((1, "output"), (0, "errors")):
                rows = reader.execute("SELECT record FROM results WHERE batch_id = ? AND ok = ? ORDER BY line",
                                      (batch["id"], ok))
                first = rows.fetchone()
                if first is None:
                    ids.append(None)
                    continue
                file_id = f"file-{name[:3]}-{batch['id'].removeprefix('batch_')}"
                chunks = ((record + "\n").encode() for (record,) in itertools.chain([first], rows))
                size = self._write_atomically(self.file_path(file_id), chunks)
                self._write("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                            (file_id, batch["owner"], "batch_output", f"{batch['id']}_{name}.jsonl", size,
                             int(time.time()), expires_at))
                ids.append(file_id)
        finally:
            reader.close()
        return ids[0], ids[1]

    def forget_before(self, cutoff: int) -> int:
        """Retention: files and finished batches created before `cutoff` (and their results) are deleted."""
        marks = ",".join("?" * len(UNFINISHED))
        in_use = f"SELECT input_file_id FROM batches WHERE status IN ({marks})"  # kept until their batch ends
        old = self._rows(f"SELECT id FROM files WHERE created_at < ? AND id NOT IN ({in_use})", (cutoff, *UNFINISHED))
        for row in old:
            self.file_path(row["id"]).unlink(missing_ok=True)
        with self._mutex:
            self._db.execute(f"DELETE FROM files WHERE created_at < ? AND id NOT IN ({in_use})", (cutoff, *UNFINISHED))
            gone = self._db.execute(f"SELECT id FROM batches WHERE created_at < ? AND status NOT IN ({marks})",
                                    (cutoff, *UNFINISHED)).fetchall()
            for (batch_id,) in gone:
                self._db.execute("DELETE FROM results WHERE batch_id = ?", (batch_id,))
                self._db.execute("DELETE FROM batches WHERE id = ?", (batch_id,))
        return len(old) + len(gone)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
