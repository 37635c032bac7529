"""Errors a caller can fix, raised anywhere below the API and turned into OpenAI-style JSON there.

They carry the OpenAI error fields (`param`, `code`) so the HTTP layer never has to guess which field was wrong,
and the CLI prints the same message.
"""

from __future__ import annotations


class ServeError(Exception):
    """Base class: `status` is the HTTP status the API answers with."""

    status = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequest(ServeError):
    status = 400
    error_type = "invalid_request_error"


class ModelNotFound(ServeError):
    status = 404
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = "model"):
        super().__init__(message, param=param, code="model_not_found")


class Overloaded(ServeError):
    """Too many requests in flight; the client should retry after a short wait."""

    status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message, code="rate_limit_exceeded")
        self.retry_after_s = retry_after_s


class ShuttingDown(ServeError):
    status = 503
    error_type = "server_error"

    def __init__(self, message: str = "server is shutting down; retry on another replica"):
        super().__init__(message, code="service_unavailable")


class PriorityNotGranted(ServeError):
    status = 403
    error_type = "permission_error"

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message, param=param, code="priority_not_granted")


class NotReady(ServeError):
    """The model is loading, failed to load, or its engine died."""

    status = 503
    error_type = "server_error"


class QueueTimeout(ServeError):
    """A request waited for a decode slot longer than its queue limit (QUEUE_TIMEOUT_S, or its own deadline) and
    never started. 503, not 429: the client sent nothing wrong and no faster than allowed; this replica is too busy
    to start it in time, which is what 503 with Retry-After says to a load balancer (retry elsewhere) and to the
    openai and anthropic SDKs (retry after a pause; on /v1/messages it is Anthropic's 529 overloaded_error)."""

    status = 503
    error_type = "server_error"

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message, code="queue_timeout")
        self.retry_after_s = retry_after_s


class ConfigError(ServeError):
    """A setting (model path, device, dtype) that cannot work; raised at startup, before anything is served."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message, param=param, code="invalid_config")
