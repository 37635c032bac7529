"""POST /v1/files, received as a stream: its multipart body goes through python-multipart's parser chunk by chunk,
and the `file` part's bytes go straight to `BATCH_DIR/files/<id>.partial`, counted as they come against
BATCH_MAX_FILE_BYTES and what the key's byte quota leaves. Nothing holds the file in memory; a refused or broken
upload leaves nothing behind.

Why not FastAPI's `UploadFile` and `Form` parameters: FastAPI reads and spools the whole form before it runs any
dependency, the API key check included, so a 100 MiB upload without a key was read in full, then answered 401.
Here the key is checked before the body is let in (app/main.py `AccessAndLimits`, then the router's
`require_api_key`), then BATCH_DIR and the key's quotas of files and bytes (service.py `begin_upload`), and only
then is the body read.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from app.errors import InvalidRequest, ServeError
from app.prepare import ClientGone

MAX_FIELD_BYTES = 1024  # `purpose`, or any other plain field a client adds
MAX_PARTS = 16
MAX_FILENAME_CHARS = 255
ENVELOPE_BYTES = 64 * 1024  # what a multipart body may add to its file: boundaries, part headers, `purpose`

# The schema of the body the route parses itself, for clients and the fuzzer (tests/server/test_fuzz.py).
UPLOAD_OPENAPI = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary", "description": "the JSONL file; at most BATCH_MAX_FILE_BYTES"},
        "purpose": {"type": "string", "description": "`batch` for a batch input file (checked now, line by line)"},
    }}}}}}


class FileTooLarge(ServeError):
    status = 413
    error_type = "invalid_request_error"

    def __init__(self, limit: int):
        super().__init__(f"the file exceeds {limit} bytes (BATCH_MAX_FILE_BYTES)", param="file",
                         code="request_too_large")


class NotStored(ServeError):
    """The disk refused the file (full, read-only): a 507 naming the cause, never the server's path."""

    status = 507
    error_type = "server_error"

    def __init__(self, err: OSError):
        super().__init__(f"the server could not store the file ({err.strerror or type(err).__name__}); retry later",
                         code="file_not_stored")


class QuotaExceeded(InvalidRequest):
    """A key's files, bytes or result rows would pass its quota. A 400, not a 429: waiting does not help (deleting
    files does, or BATCH_RETENTION_S), and the SDKs retry a 429 by sending the whole file again."""


class Upload:
    """One file being received, written to its `.partial` name as it comes; `reserved` is what the owner's byte
    quota left it when it began (service.py `begin_upload`)."""

    def __init__(self, file_id: str, owner: str, path: os.PathLike, max_bytes: int, reserved: int, quota: int):
        self.file_id, self.owner, self.path = file_id, owner, path
        self.max_bytes, self.reserved, self.quota = max_bytes, reserved, quota
        self.size = 0
        self._file = open(path, "wb")

    def write(self, data: bytes) -> None:
        """On a worker thread: a chunk of the file, refused (and nothing more written) past either limit."""
        self.size += len(data)
        if self.size > self.max_bytes:
            raise FileTooLarge(self.max_bytes)
        if self.size > self.reserved:
            raise QuotaExceeded(f"the file would take the files stored under this key past "
                                f"BATCH_MAX_STORED_BYTES_PER_KEY ({self.quota} bytes); delete files "
                                "(DELETE /v1/files/{id}) to make room", param="file", code="bytes_quota_exceeded")
        self._file.write(data)

    def close(self) -> None:
        """Flushed and fsynced: the body is whole on disk before it is renamed into place and listed."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def discard(self) -> None:
        self._file.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass  # listed: renamed into place


async def receive_upload(request: Request, service, tenant: str | None) -> dict[str, Any]:
    """The route's work, after the key check: the file object of a stored upload, or the error that refused it."""
    boundary = form_boundary(request.headers.get("content-type", ""))
    length = request.headers.get("content-length", "")
    try:
        upload = await asyncio.to_thread(service.begin_upload, tenant, int(length) if length.isdigit() else None)
    except OSError as err:
        raise NotStored(err) from None
    try:
        form = UploadForm(service.check_purpose)
        try:
            parser = MultipartParser(boundary, form.callbacks())
            async for chunk in request.stream():
                parser.write(chunk)
                if form.file_data:  # the file's bytes in this chunk, written off the event loop
                    data = b"".join(form.file_data)
                    form.file_data.clear()
                    await asyncio.to_thread(upload.write, data)
            parser.finalize()
        except FormParserError:
            raise InvalidRequest("the body is not valid multipart/form-data", param="file") from None
        except ClientDisconnect:
            raise ClientGone() from None
        form.check_whole()
        return await asyncio.to_thread(service.finish_upload, upload, form.fields["purpose"], form.filename)
    except OSError as err:
        raise NotStored(err) from None
    finally:
        await asyncio.to_thread(service.end_upload, upload)


def form_boundary(content_type: str) -> bytes:
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise InvalidRequest("upload the file as multipart/form-data, with `file` and `purpose` fields",
                             param="file")
    return boundary


class UploadForm:
    """python-multipart's callbacks for an upload's form: the `file` part's bytes are queued for the disk as they
    are parsed, the other fields kept (at most MAX_FIELD_BYTES each), and `purpose` checked as soon as it ends, so
    a wrong one is refused before a file sent after it is read."""

    def __init__(self, check_purpose):
        self.check_purpose = check_purpose
        self.fields: dict[str, str] = {}
        self.filename: str | None = None  # set once the `file` part has begun
        self.file_data: list[bytes] = []
        self.parts, self.ended = 0, False
        self._header, self._value = bytearray(), bytearray()
        self._disposition = b""
        self._name, self._in_file = "", False

    def callbacks(self) -> dict[str, Any]:
        return {"on_part_begin": self.on_part_begin, "on_header_field": self.on_header_field,
                "on_header_value": self.on_header_value, "on_header_end": self.on_header_end,
                "on_headers_finished": self.on_headers_finished, "on_part_data": self.on_part_data,
                "on_part_end": self.on_part_end, "on_end": self.on_end}

    def on_part_begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise InvalidRequest(f"the form has more than {MAX_PARTS} parts; an upload is `file` and `purpose`")
        self._disposition, self._name, self._in_file = b"", "", False
        self._value.clear()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]  # python-multipart bounds a part's headers (4 KiB, 8 of them)

    def on_header_end(self) -> None:
        if bytes(self._header).lower() == b"content-disposition":
            self._disposition = bytes(self._value)
        self._header.clear()
        self._value.clear()

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        self._name = options.get(b"name", b"").decode("utf-8", "replace")
        if b"filename" not in options:
            return
        if self._name != "file" or self.filename is not None:
            raise InvalidRequest("an upload is one file, in the form's `file` part", param="file")
        self._in_file = True
        name = options[b"filename"].decode("utf-8", "replace").replace("\\", "/").rsplit("/", 1)[-1]
        self.filename = name[:MAX_FILENAME_CHARS]

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            self.file_data.append(data[start:end])
            return
        self._value += data[start:end]
        if len(self._value) > MAX_FIELD_BYTES:
            raise InvalidRequest(f"the form's `{self._name[:64]}` field is over {MAX_FIELD_BYTES} bytes",
                                 param=self._name[:64] or None)

    def on_part_end(self) -> None:
        if self._in_file:
            return
        value = self._value.decode("utf-8", "replace")
        self._value.clear()
        if self._name == "purpose":
            self.check_purpose(value)
        self.fields[self._name] = value

    def on_end(self) -> None:
        self.ended = True

    def check_whole(self) -> None:
        if not self.ended:
            raise InvalidRequest("the multipart body ends before its closing boundary", param="file")
        if self.filename is None:
            raise InvalidRequest("`file` is required: the form's file part", param="file")
        if "purpose" not in self.fields:
            raise InvalidRequest("`purpose` is required", param="purpose")
