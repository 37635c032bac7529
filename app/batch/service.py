"""Files and Batches for the routes: OpenAI's objects, limits and owners, over the store and the runner.

Owners: with API keys set, a file or batch belongs to the key that created it, and every other key gets a 404 for
it, as for anything that does not exist. The owner stored is an HMAC of the key under a secret kept in BATCH_DIR,
so it is stable across restarts (a resumed batch runs as its owner) and no key is written to disk. Without keys,
everything belongs to one owner.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
import time
from typing import Any, BinaryIO

from app.auth import ApiKeys, split_keys
from app.batch.lines import ENDPOINTS, BadInput, check_file
from app.batch.runner import BatchRunner, window_seconds
from app.batch.store import QuotaRefused, Store
from app.batch.uploads import ENVELOPE_BYTES, QuotaExceeded, Upload
from app.errors import InvalidRequest, ServeError

FILE_PURPOSES = ("batch", "batch_output", "user_data", "fine-tune", "assistants", "vision", "evals")
MAX_LIST_LIMIT = 100


class NotFound(ServeError):
    status = 404
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message, param=param, code="not_found")


class TooManyBatches(ServeError):
    status = 429
    error_type = "rate_limit_error"


class BatchService:
    def __init__(self, store: Store, runner: BatchRunner, settings, api_keys: ApiKeys, endpoints: list[str]):
        self.store, self.runner, self.settings = store, runner, settings
        self.endpoints = [e for e in ENDPOINTS if e in endpoints]  # what this server's model serves
        keys = split_keys(settings.api_key)
        owner = {api_keys.digest(k): self._owner_of_key(k) for k in keys}
        self._owner_by_tenant = owner
        self._tenant_by_owner = {o: t for t, o in owner.items()}
        self._receiving: list[Upload] = []  # uploads being received: counted against their owners' quotas
        self._quota_lock = threading.Lock()

    def _owner_of_key(self, key: str) -> str:
        return hmac.new(self.store.owner_secret, key.encode(), hashlib.sha256).hexdigest()

    def owner(self, tenant: str | None) -> str:
        return self._owner_by_tenant.get(tenant, "") if tenant else ""

    def tenant(self, owner: str) -> str | None:
        """The tenant a batch's lines run as: its owner's key, as configured now."""
        return self._tenant_by_owner.get(owner) if owner else None

    # ---- files ----

    # An upload (uploads.py receives it): begin_upload before its body is read, finish_upload once it is whole,
    # end_upload always. Called on worker threads.

    def check_purpose(self, purpose: str) -> None:
        if purpose not in FILE_PURPOSES:
            raise InvalidRequest(f"`purpose` must be one of {', '.join(FILE_PURPOSES)}", param="purpose")

    def begin_upload(self, tenant: str | None, body_bytes: int | None) -> Upload:
        """A new upload, within its owner's quotas counting the uploads still being received: one file more than
        BATCH_MAX_FILES_PER_KEY allows, or a body (when its length is declared) bigger than what
        BATCH_MAX_STORED_BYTES_PER_KEY leaves, is refused now, before its body is read. It reserves what it may
        write: its declared length, at most what the quota leaves."""
        s, owner = self.settings, self.owner(tenant)
        who = "this key" if owner else "this server"
        with self._quota_lock:
            files, stored = self.store.usage(owner)
            receiving = [u for u in self._receiving if u.owner == owner]
            if files + len(receiving) >= s.batch_max_files_per_key:
                raise QuotaExceeded(f"{who} already keeps {files + len(receiving)} files, the most "
                                    f"BATCH_MAX_FILES_PER_KEY ({s.batch_max_files_per_key}) allows; delete some "
                                    "(DELETE /v1/files/{id})", param="file", code="files_quota_exceeded")
            left = s.batch_max_stored_bytes_per_key - stored - sum(u.reserved for u in receiving)
            if left <= 0 or (body_bytes is not None and body_bytes - ENVELOPE_BYTES > left):
                raise QuotaExceeded(f"the file would take {who}'s stored files past BATCH_MAX_STORED_BYTES_PER_KEY "
                                    f"({s.batch_max_stored_bytes_per_key} bytes; {stored} in use); delete files "
                                    "(DELETE /v1/files/{id}) to make room", param="file",
                                    code="bytes_quota_exceeded")
            file_id = self.store.new_file_id()
            upload = Upload(file_id, owner, self.store.partial_path(file_id), s.batch_max_file_bytes,
                            min(left, body_bytes if body_bytes is not None else left),
                            s.batch_max_stored_bytes_per_key)
            self._receiving.append(upload)
        return upload

    def finish_upload(self, upload: Upload, purpose: str, filename: str | None) -> dict[str, Any]:
        """The received file checked (a batch input line by line, as OpenAI does at upload), renamed into place
        and listed."""
        self.check_purpose(purpose)
        upload.close()
        if purpose == "batch":
            try:
                check_file(upload.path, None, self.settings.batch_max_lines)
            except BadInput as err:
                raise InvalidRequest(f"the file is not a valid batch input: {err}", param="file") from None
        expires = int(time.time() + self.settings.batch_retention_s)
        with self._quota_lock:  # listed and no longer receiving in one step: counted once, never twice or not at all
            row = self.store.add_file(upload.file_id, upload.owner, purpose, filename or "upload.jsonl",
                                      upload.size, expires)
            self._receiving.remove(upload)
        return file_object(row)

    def end_upload(self, upload: Upload) -> None:
        """After an upload, listed or not: one that was not is removed."""
        with self._quota_lock:
            if upload in self._receiving:
                self._receiving.remove(upload)
        upload.discard()

    def check_result_rows(self, owner: str, new_total: int) -> None:
        """Before a batch of `new_total` requests is created: its owner's retained batches (finished or not, until
        BATCH_RETENTION_S) may hold BATCH_MAX_RESULT_ROWS_PER_KEY requests in all, each a row in SQLite and a line
        of an output file."""
        quota = self.settings.batch_max_result_rows_per_key
        used = self.store.result_rows(owner)
        if used + new_total > quota:
            who = "this key's" if owner else "this server's"
            raise QuotaExceeded(f"this batch's {new_total} requests would take {who} retained batches past "
                                f"BATCH_MAX_RESULT_ROWS_PER_KEY ({quota} requests; {used} in batches kept until "
                                "BATCH_RETENTION_S)", param="input_file_id", code="result_rows_quota_exceeded")

    def file(self, tenant: str | None, file_id: str) -> dict[str, Any]:
        row = self.store.file(file_id, self.owner(tenant))
        if row is None:
            raise NotFound(f"no file with id {file_id!r}", param="file_id")
        return row

    def files(self, tenant: str | None, purpose: str | None, after: str | None, limit: int) -> dict[str, Any]:
        rows = self.store.files(self.owner(tenant), purpose)
        if after is not None:
            ids = [r["id"] for r in rows]
            rows = rows[ids.index(after) + 1:] if after in ids else []
        return page([file_object(r) for r in rows], limit)

    def open_content(self, tenant: str | None, file_id: str) -> tuple[int, BinaryIO]:
        """(size, the file opened for reading): the route streams it, so memory does not grow with its size. Open,
        it stays readable if the file is deleted meanwhile."""
        self.file(tenant, file_id)
        try:
            f = open(self.store.file_path(file_id), "rb")
        except FileNotFoundError:  # deleted since its row was read
            raise NotFound(f"no file with id {file_id!r}", param="file_id") from None
        return os.fstat(f.fileno()).st_size, f

    def delete(self, tenant: str | None, file_id: str) -> dict[str, Any]:
        if self.store.file(file_id, self.owner(tenant)) is not None and (using := self.store.batch_using(file_id)):
            raise InvalidRequest(f"file {file_id!r} is the input of batch {using!r}, which has not finished; delete "
                                 "it once the batch ends (or cancel the batch)", param="file_id", code="file_in_use")
        if not self.store.delete_file(file_id, self.owner(tenant)):
            raise NotFound(f"no file with id {file_id!r}", param="file_id")
        return {"id": file_id, "object": "file", "deleted": True}

    # ---- batches ----

    def create(self, tenant: str | None, input_file_id: Any, endpoint: Any, completion_window: Any,
               metadata: Any) -> dict[str, Any]:
        if not isinstance(input_file_id, str):
            raise InvalidRequest("`input_file_id` must be a file id", param="input_file_id")
        if endpoint not in self.endpoints:
            raise InvalidRequest(f"`endpoint` must be one of {', '.join(self.endpoints)} on this server",
                                 param="endpoint")
        seconds = window_seconds(completion_window) if isinstance(completion_window, str) else None
        if seconds is None:
            raise InvalidRequest('`completion_window` must be "24h" (or another "<n>s|m|h|d", at most a year)',
                                 param="completion_window")
        if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(
                isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                for k, v in metadata.items())):
            raise InvalidRequest("`metadata` must be at most 16 string pairs (keys up to 64 characters, values up "
                                 "to 512)", param="metadata")
        owner = self.owner(tenant)
        row = self.store.file(input_file_id, owner)
        if row is None:
            raise NotFound(f"no file with id {input_file_id!r}", param="input_file_id")
        if row["purpose"] != "batch":
            raise InvalidRequest(f"file {input_file_id!r} was uploaded with purpose {row['purpose']!r}, not "
                                 "'batch'", param="input_file_id")
        try:  # streamed: only a digest per custom_id is kept
            _, total = check_file(self.store.file_path(input_file_id), endpoint, self.settings.batch_max_lines)
        except BadInput as err:
            raise InvalidRequest(f"input file {input_file_id!r}: {err}", param="input_file_id") from None
        except FileNotFoundError:  # deleted since its row was read
            raise NotFound(f"no file with id {input_file_id!r}", param="input_file_id") from None
        self.check_result_rows(owner, total)
        try:  # both bounds again, in the insert's own transaction: concurrent creates cannot pass them together
            batch = self.store.add_batch(owner, endpoint, input_file_id, completion_window, total,
                                         int(time.time()) + seconds, metadata, self.settings.batch_max_in_progress,
                                         self.settings.batch_max_result_rows_per_key)
        except QuotaRefused:
            self.check_result_rows(owner, total)  # raises, with the message and the figures as they are now
            raise
        if batch is None:
            raise TooManyBatches(f"{self.settings.batch_max_in_progress} batches are already in progress for this "
                                 "key (BATCH_MAX_IN_PROGRESS); retry when one has finished")
        self.runner.start(batch["id"])
        return self.batch_object(batch)

    def batch(self, tenant: str | None, batch_id: str) -> dict[str, Any]:
        row = self.store.batch(batch_id, self.owner(tenant))
        if row is None:
            raise NotFound(f"no batch with id {batch_id!r}", param="batch_id")
        return self.batch_object(row)

    def batches(self, tenant: str | None, after: str | None, limit: int) -> dict[str, Any]:
        rows = self.store.batches(self.owner(tenant), after, limit + 1)
        return page([self.batch_object(r) for r in rows], limit)

    def cancel(self, tenant: str | None, batch_id: str) -> dict[str, Any]:
        row = self.store.batch(batch_id, self.owner(tenant))
        if row is None:
            raise NotFound(f"no batch with id {batch_id!r}", param="batch_id")
        if not self.store.set_status(batch_id, "cancelling", only_from=("validating", "in_progress")):
            if row["status"] not in ("cancelling", "cancelled"):
                raise InvalidRequest(f"batch {batch_id!r} is {row['status']} and cannot be cancelled",
                                     param="batch_id", code="invalid_state")
        self.runner.cancel(batch_id)  # its lines in flight stop at once
        return self.batch_object(self.store.batch(batch_id))

    def batch_object(self, row: dict[str, Any]) -> dict[str, Any]:
        counts = self.store.counts(row)
        return {
            "id": row["id"], "object": "batch", "endpoint": row["endpoint"],
            "errors": json.loads(row["errors"]) if row["errors"] else None,
            "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
            "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
            **{k: row[k] for k in ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
                                   "failed_at", "expired_at", "cancelling_at", "cancelled_at")},
            "request_counts": {"total": counts.total, "completed": counts.completed, "failed": counts.failed},
            "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
        }


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "expires_at": row["expires_at"], "filename": row["filename"], "purpose": row["purpose"],
            "status": "processed", "status_details": None}


def page(items: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    shown = items[:limit]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(items) > limit}


def open_batch_service(state) -> BatchService:
    """The service over the store that create_app opened, once the model is loaded: its runner resumes every batch
    a previous process left unfinished, and drops what is past BATCH_RETENTION_S (now, then hourly)."""
    from functools import partial

    from app.entry import Caller, call

    s = state.settings
    store: Store = state.batch_store
    endpoints = state.embedding.endpoints if state.kind == "embedding" else ["/v1/chat/completions",
                                                                             "/v1/completions", "/v1/responses"]
    metrics = state.metrics
    runner = BatchRunner(store, partial(call, state), s.batch_concurrency, s.batch_max_lines,
                         draining=lambda: state.draining,
                         on_line=lambda ok: metrics.batch_lines.labels("ok" if ok else "error").inc())
    service = BatchService(store, runner, s, state.api_keys, endpoints)

    def caller_of(owner: str) -> Caller | None:
        """A batch's lines run as its owner: its key's tenant (None when that key is gone), in the batch class."""
        tenant = service.tenant(owner)
        if state.api_keys and tenant is None:
            return None
        return Caller(tenant, s.prefix_cache_per_key, background=True, name=f"batch-{owner[:12] or 'local'}")

    runner.caller_of = caller_of
    metrics.batches_in_progress.set_function(lambda: store.count_in_progress())
    runner.tidy(s.batch_retention_s)
    runner.resume_all()
    return service
