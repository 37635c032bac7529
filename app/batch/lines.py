"""A batch input file, read and checked as a whole before anything runs (OpenAI's rules): every line a JSON object
with a unique `custom_id`, `"method": "POST"`, the batch's own `url` and a `body` object that does not ask to
stream. A file that breaks one is refused at create, naming the line; a line whose body the route refuses is not a
file error: it runs, and its 400 goes to the error file, as the route would have answered it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

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


def read_lines(data: bytes, endpoint: str | None, max_lines: int) -> list[Line]:
    """`endpoint`: the batch's; None (the offline command) takes the first line's for the whole file."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadInput(f"the file is not UTF-8 (byte {err.start})") from None
    lines: list[Line] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(lines) >= max_lines:
            raise BadInput(f"line {number}: the file has more than {max_lines:,} requests (BATCH_MAX_LINES)")
        line = parse_line(number, raw, endpoint)
        endpoint = endpoint or line.url
        if line.custom_id in seen:
            raise BadInput(f"line {number}: custom_id {line.custom_id!r} is used by an earlier line; each must be "
                           "unique")
        seen.add(line.custom_id)
        lines.append(line)
    if not lines:
        raise BadInput("the file has no requests")
    return lines


def parse_line(number: int, raw: str, endpoint: str | None) -> Line:
    try:
        item = json.loads(raw)
    except ValueError as err:
        raise BadInput(f"line {number}: not valid JSON ({err.msg})") from None
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


def error_record(line: Line, code: str, message: str) -> dict[str, Any]:
    """A line that never ran (the batch expired or was cancelled first), in OpenAI's shape."""
    return {"id": f"batch_req_{line.number}", "custom_id": line.custom_id, "response": None,
            "error": {"code": code, "message": message}}
