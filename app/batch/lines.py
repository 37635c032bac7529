"""A batch input file, read as a stream of lines (OpenAI's rules): every line a JSON object with a unique
`custom_id`, `"method": "POST"`, the batch's own `url` and a `body` object that does not ask to stream. A file that
breaks one is refused at upload and at create, naming the line; a line whose body the route refuses is not a file
error: it runs, and its 400 goes to the error file, as the route would have answered it.

Why a stream: an input file may be BATCH_MAX_FILE_BYTES (100 MiB), and parsed whole it held about 3.5x that in
Python objects, for every unfinished batch at once. `check_file` reads it once keeping only a digest per custom_id;
`iter_lines` parses each line when the runner is about to run it.

JSONL lines end at `\\n` (or `\\r\\n`) only: `str.splitlines` also splits at U+2028, U+2029 and U+0085, which are
legal raw inside a JSON string (and which our own output records hold raw, written with `ensure_ascii=False`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
MAX_CUSTOM_ID_CHARS = 512


class BadInput(ValueError):
    """The input file as a whole is refused; the message names the line."""


@dataclass(frozen=True)
class Line:
    number: int  # 1-based, as an editor shows it
    custom_id: str
    url: str
    body: dict[str, Any]


def raw_lines(f: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """(1-based number, bytes) of each line, split at `\\n` only, a `\\r` before it dropped; blank lines skipped."""
    for number, raw in enumerate(f, start=1):  # a binary file iterates at b"\n" alone
        raw = raw.rstrip(b"\n").rstrip(b"\r")
        if raw.strip():
            yield number, raw


def check_file(path: Path, endpoint: str | None, max_lines: int) -> tuple[str, int]:
    """Check a whole input file without keeping it: (its endpoint, its count of requests), or BadInput naming the
    first bad line. `endpoint`: the batch's; None (an upload, the offline command) takes the first line's."""
    seen: set[bytes] = set()  # a digest per custom_id: 16 bytes each, not the id itself
    count = 0
    with open(path, "rb") as f:
        for number, raw in raw_lines(f):
            if count >= max_lines:
                raise BadInput(f"line {number}: the file has more than {max_lines:,} requests (BATCH_MAX_LINES)")
            line = parse_line(number, raw, endpoint)
            endpoint = endpoint or line.url
            digest = hashlib.blake2b(line.custom_id.encode(), digest_size=16).digest()
            if digest in seen:
                raise BadInput(f"line {number}: custom_id {line.custom_id!r} is used by an earlier line; each must "
                               "be unique")
            seen.add(digest)
            count += 1
    if not count:
        raise BadInput("the file has no requests")
    return endpoint, count


def iter_lines(path: Path, endpoint: str | None, skip: set[int] = frozenset()) -> Iterator[Line]:
    """The file's requests, each parsed when it is asked for; line numbers in `skip` (already answered) are not
    parsed at all. The file was checked whole by `check_file` first."""
    with open(path, "rb") as f:
        for number, raw in raw_lines(f):
            if number not in skip:
                yield parse_line(number, raw, endpoint)


def parse_line(number: int, raw: bytes | str, endpoint: str | None) -> Line:
    try:
        item = json.loads(raw)
    except UnicodeDecodeError as err:
        raise BadInput(f"line {number}: not UTF-8 (byte {err.start})") from None
    except ValueError as err:
        raise BadInput(f"line {number}: not valid JSON ({getattr(err, 'msg', err)})") from None
    except RecursionError:
        raise BadInput(f"line {number}: nested too deeply") from None
    if not isinstance(item, dict):
        raise BadInput(f"line {number}: each line must be a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise BadInput(f"line {number}: `custom_id` must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters")
    if item.get("method") != "POST":
        raise BadInput(f"line {number}: `method` must be \"POST\"")
    url = item.get("url")
    if url not in ENDPOINTS:
        raise BadInput(f"line {number}: `url` must be one of {', '.join(ENDPOINTS)}, got {url!r}")
    if endpoint is not None and url != endpoint:
        raise BadInput(f"line {number}: `url` {url!r} differs from the batch's endpoint {endpoint!r}; a batch "
                       "runs one endpoint")
    body = item.get("body")
    if not isinstance(body, dict):
        raise BadInput(f"line {number}: `body` must be a JSON object")
    if body.get("stream"):
        raise BadInput(f"line {number}: `stream: true` is not allowed in a batch; its answer is written to the "
                       "output file")
    return Line(number, custom_id, url, body)


def output_record(line: Line, status: int, body: Any, request_id: str) -> dict[str, Any]:
    """One line of the output (or error) file, in OpenAI's shape."""
    return {"id": f"batch_req_{request_id}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def output_record_json(line: Line, status: int, body_json: bytes, request_id: str) -> str:
    """`output_record` as its JSON line, around a body that is already JSON (the serving layer's bytes): written as
    they came, never parsed and dumped again (a prompt-logprobs answer is megabytes of JSON)."""
    head = json.dumps({"id": f"batch_req_{request_id}", "custom_id": line.custom_id}, ensure_ascii=False)[:-1]
    return (f'{head}, "response": {{"status_code": {int(status)}, "request_id": {json.dumps(request_id)}, '
            f'"body": {body_json.decode("utf-8")}}}, "error": null}}')


def error_record(line: Line, code: str, message: str) -> dict[str, Any]:
    """A line that never ran (the batch expired or was cancelled first), in OpenAI's shape."""
    return {"id": f"batch_req_{line.number}", "custom_id": line.custom_id, "response": None,
            "error": {"code": code, "message": message}}
