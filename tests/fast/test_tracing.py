"""OpenTelemetry traces, on the tiny model over a real socket, against a real OTLP/HTTP receiver in the test (an
http.server thread that decodes `ExportTraceServiceRequest` with opentelemetry-proto): a request's span carries the
GenAI attributes, is the child of the client's `traceparent`, and has queue / prefill / decode children. With the
collector down, requests are unaffected; with no endpoint set, the SDK is never imported."""

from __future__ import annotations

import gzip
import http.server
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import free_port

pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest, ExportTraceServiceResponse)

CHAT = "/v1/chat/completions"
TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


class Receiver:
    """Collects the spans POSTed to /v1/traces: (resource attributes, span) pairs."""

    def __init__(self):
        spans = self.spans = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    resource = attributes(resource_spans.resource.attributes)
                    for scope_spans in resource_spans.scope_spans:
                        spans.extend((resource, span) for span in scope_spans.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, name: str, timeout: float = 15.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [(r, s) for r, s in self.spans if s.name == name]
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"no span {name!r} arrived; got {[s.name for _, s in self.spans]}")


def attributes(kvs) -> dict:
    out = {}
    for kv in kvs:
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = ([getattr(v, v.WhichOneof("value")) for v in value.array_value.values]
                       if kind == "array_value" else getattr(value, kind))
    return out


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.server.shutdown()


def test_a_requests_span_reaches_the_collector_as_the_child_of_its_traceparent(make_tiny_server, receiver,
                                                                                monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "serve-under-test")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: export soon after the request
    server = make_tiny_server()
    r = httpx.post(server.url + CHAT, headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01",
                                               "x-request-id": "traced-1"},
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                         "temperature": 0.5, "ignore_eos": True})
    assert r.status_code == 200
    [(resource, span)] = receiver.wait_for("chat tiny")
    assert resource["service.name"] == "serve-under-test"
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    a = attributes(span.attributes)
    assert a["gen_ai.request.model"] == "tiny" and a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == 5 and a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.response.id"] == "chatcmpl-traced-1" and a["http.response.status_code"] == 200
    children = {s.name: s for _, s in receiver.wait_for("decode") + receiver.wait_for("queue")
                + receiver.wait_for("prefill")}
    for child in children.values():
        assert child.parent_span_id == span.span_id and child.trace_id == span.trace_id
        assert span.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano
        assert child.end_time_unix_nano <= span.end_time_unix_nano
    assert children["prefill"].end_time_unix_nano <= children["decode"].start_time_unix_nano + 1000


def test_requests_are_unaffected_when_the_collector_is_down(make_tiny_server, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    server = make_tiny_server()
    assert server.state.tracing is not None
    for _ in range(5):
        started = time.perf_counter()
        r = httpx.post(server.url + CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
        assert time.perf_counter() - started < 1.0  # far under the exporter's 2 s timeout: it never waits on it
        time.sleep(0.1)  # the batch processor tries its export meanwhile


@pytest.mark.full  # a process of its own: 11 s on a Zen 3
def test_without_an_endpoint_the_sdk_is_never_imported(tiny_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    code = ("import sys; from app.config import Settings; from app.main import create_app; "
            f"app = create_app(Settings(model={str(tiny_dir)!r})); "
            "assert app.state.serve.tracing is None; "
            "assert not [m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))]")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120, cwd=os.getcwd())
