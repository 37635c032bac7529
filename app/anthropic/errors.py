"""Errors in Anthropic's shape for the `/v1/messages` routes: `{"type": "error", "error": {"type", "message"}}`.

The same ServeErrors are raised below as for the OpenAI routes; only the body (and two statuses) differ. Anthropic's
types by status: 400 invalid_request_error, 401 authentication_error, 403 permission_error, 404 not_found_error,
413 request_too_large, 429 rate_limit_error, 500 api_error, 529 overloaded_error. Our 503s (draining, still
loading, engine gone) answer 529 `overloaded_error`, the status Anthropic's clients know means "retry later"; a
full queue stays 429 with its Retry-After, as on the OpenAI routes.
"""

from __future__ import annotations

from typing import Any

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               529: "overloaded_error"}
STATUS_FOR = {503: 529}  # our status -> Anthropic's


def is_messages_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_status(status: int) -> int:
    return STATUS_FOR.get(status, status)


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """The error body for an answer with this (Anthropic) status."""
    kind = ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
