"""OpenTelemetry traces, only when the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set.

Unset, `tracing_from_env()` returns None and nothing of OpenTelemetry's SDK is imported: no cost. Set, the SDK
(the `otel` extra) is imported here, lazily, and each generation request (chat, completions, responses, messages)
becomes one SERVER span exported over OTLP/HTTP, with the GenAI semantic conventions' attributes and three child
spans on the engine's own clock: `queue` (submitted to admitted), `prefill` (admitted to the first token) and
`decode` (the first token to the last). An incoming W3C `traceparent` makes the request's span its child.

The spans are written once the response is out, with the times the request recorded (the middleware's arrival,
the engine handle's steps), so nothing is traced on the engine's thread or while tokens flow. Export happens in the
SDK's BatchSpanProcessor thread, with a short exporter timeout (`EXPORT_TIMEOUT_S` unless
OTEL_EXPORTER_OTLP_TIMEOUT / OTEL_EXPORTER_OTLP_TRACES_TIMEOUT say otherwise): a collector that is down costs
a request nothing; its spans are dropped after that timeout. The SDK reads its other standard variables itself:
OTEL_SERVICE_NAME (default here: simple-serve), OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER, OTEL_BSP_*.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from app.logs import served_model

log = logging.getLogger("app.tracing")
EXPORT_TIMEOUT_S = 2.0
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/responses": "chat", "/v1/messages": "chat",
              "/v1/completions": "text_completion"}


def tracing_from_env() -> Tracing | None:
    if not (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        return None
    return Tracing()


class Tracing:
    def __init__(self) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._kind, self._status, self._code, self._in = SpanKind.SERVER, Status, StatusCode, set_span_in_context
        self._propagator = TraceContextTextMapPropagator()
        # explicit attributes win over OTEL_SERVICE_NAME in the SDK's merge, so ours is only the fallback
        named = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "simple-serve"}
        self.provider = TracerProvider(resource=Resource.create(named))  # reads OTEL_TRACES_SAMPLER
        timeout = None if (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
                           or os.environ.get("OTEL_EXPORTER_OTLP_TIMEOUT")) else EXPORT_TIMEOUT_S
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(timeout=timeout)))
        self.tracer = self.provider.get_tracer("simple-serve")
        log.info("OpenTelemetry traces on: OTLP/HTTP to %s", os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                 or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))

    def record(self, scope: dict, info: dict[str, Any], status: int) -> None:
        """One request's spans, from what it recorded in `info` (its request.state); never raises."""
        try:
            self._record(scope, info, status)
        except Exception:  # noqa: BLE001 - tracing must never fail a request
            log.exception("a request's trace could not be recorded")

    def _record(self, scope: dict, info: dict[str, Any], status: int) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        parent = self._propagator.extract(headers)  # an empty context without a valid traceparent
        arrived_ns, arrived = info["arrived_ns"], info["arrived"]

        def ns(t: float | None) -> int | None:  # the engine's perf_counter times on the span's wall clock
            return None if t is None else arrived_ns + int((t - arrived) * 1e9)

        operation = OPERATIONS.get(scope.get("path"), "chat")
        # the adapter the request ran with, as its answer's `model` says, else the base
        model = served_model(info, scope["app"].state.serve.settings.model_id) if "app" in scope else None
        sampling, choices = info.get("sampling"), info.get("choices") or []
        attributes: dict[str, Any] = {"gen_ai.operation.name": operation, "gen_ai.request.model": model,
                                      "http.request.method": scope.get("method"), "url.path": scope.get("path"),
                                      "http.response.status_code": status, "request.id": info.get("x_request_id")}
        if sampling is not None:
            attributes |= {"gen_ai.request.max_tokens": sampling.max_tokens,
                           "gen_ai.request.temperature": sampling.temperature if sampling.do_sample else 0.0,
                           "gen_ai.request.top_p": sampling.top_p}
        if "prompt_tokens" in info:
            attributes |= {"gen_ai.usage.input_tokens": info["prompt_tokens"],
                           "gen_ai.usage.output_tokens": info.get("completion_tokens", 0)}
        if reasons := info.get("finish_reasons"):
            attributes["gen_ai.response.finish_reasons"] = [r or "error" for r in reasons]
        if response_id := info.get("request_id"):
            attributes["gen_ai.response.id"] = response_id
        span = self.tracer.start_span(f"{operation} {model}", context=parent, kind=self._kind, start_time=arrived_ns,
                                      attributes={k: v for k, v in attributes.items() if v is not None})
        if status >= 500 or info.get("failed_status"):
            span.set_status(self._status(self._code.ERROR, f"HTTP {info.get('failed_status', status)}"))
        if choices:
            handle, inside = choices[0].handle, self._in(span)
            phases = [("queue", handle.submitted_at, handle.admitted_at),
                      ("prefill", handle.admitted_at, handle.first_token_at),
                      ("decode", handle.first_token_at, handle.last_token_at or None)]
            for name, start, end in phases:
                if start is not None and end is not None:
                    self.tracer.start_span(name, context=inside, start_time=ns(start)).end(end_time=ns(end))
        span.end(end_time=time.time_ns())

    def close(self) -> None:
        self.provider.shutdown()
