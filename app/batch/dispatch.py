"""One batch line through the server's own routes, in-process: the ASGI app is called as uvicorn would call it,
so the line meets the same body parsing, validation, limits, serving code and errors as an HTTP client.

The caller's identity travels in the ASGI scope's `state` (`batch_tenant`), which only in-process callers can set:
uvicorn builds each network request's scope afresh. app/api.py's key check reads it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

# Lines run one after another within a slot; a line's body is at most MAX_REQUEST_BYTES like any request's.


async def call_route(app, path: str, body: dict[str, Any], tenant: str | None) -> tuple[int, Any, str]:
    """POST `body` to `path` on `app`; returns (status, parsed JSON body, request id)."""
    raw = json.dumps(body, ensure_ascii=False).encode()
    request_id = uuid.uuid4().hex
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                    (b"x-request-id", request_id.encode())],
        "client": ("batch", 0), "server": ("batch", 0),
        "state": {"batch_tenant": tenant if tenant is not None else ""},
    }
    sent = False
    finished = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await finished.wait()  # the "client" stays until the answer is whole: never a disconnect mid-line
        return {"type": "http.disconnect"}

    status = 500
    chunks: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await app(scope, receive, send)
    finally:
        finished.set()
    payload = b"".join(chunks)
    try:
        parsed = json.loads(payload) if payload else None
    except ValueError:
        parsed = {"error": {"message": payload.decode("utf-8", "replace")[:1000], "type": "server_error",
                            "param": None, "code": None}}
    return status, parsed, request_id
