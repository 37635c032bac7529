"""A client that opens a stream and stops reading (issue 34, finding 10): its socket buffers fill, every send
waits, and without a send timeout its request kept its decode slot until max_tokens. Now the stream is ended
once no event or ping goes out for SSE_SEND_TIMEOUT_S, and the generation is cancelled like a client that left."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from conftest import ThreadServer

from app.config import Settings
from test_api import metric

SEND_TIMEOUT_S = 1.0
MAX_TOKENS = 230  # the tiny model's context is 256
STEP_S = 0.05  # per engine step: MAX_TOKENS would take over 11 s to generate
N = 4  # choices: the buffers (64 KiB in uvicorn, a few in the kernel) fill within a few steps


def stalled_stream(url: str, path: str, body: dict) -> socket.socket:
    """Send a streaming request over a socket with a tiny receive buffer, and then read nothing."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect, so the window stays small
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def small_buffer_server(lm, **settings) -> ThreadServer:
    """A tiny-model server whose connections have small send buffers, so that a client that reads nothing stalls
    its sends after a few events (the kernel's autotuned buffers would take megabytes first)."""
    from app.main import create_app

    server = ThreadServer(create_app(Settings(model="tiny", **settings), lm=lm))
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted sockets inherit it
    listener.bind(("127.0.0.1", server.port))
    server.thread = threading.Thread(target=server.server.run, kwargs={"sockets": [listener]}, daemon=True)
    return server


@pytest.mark.alone  # it waits out a send timeout: its clock must not be the other worker's
def test_a_client_that_stops_reading_loses_its_slot_within_the_send_timeout(tiny_lm, monkeypatch):
    import app.core.engine.step as step_module

    real = step_module.run_pass
    monkeypatch.setattr(step_module, "run_pass", lambda *a, **k: (time.sleep(STEP_S), real(*a, **k))[1])
    with small_buffer_server(tiny_lm, sse_send_timeout_s=SEND_TIMEOUT_S) as server:
        check_stalled_stream_is_ended(server)


def check_stalled_stream_is_ended(server: ThreadServer) -> None:
    lengths_before = metric(server, 'simple_serve_generations_finished_total{reason="length"}')
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "stream": True,
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "n": N, "logprobs": True, "top_logprobs": 20,
            "inspect": {"top": 20}}  # a few KiB per event, N events per step
    started = time.monotonic()
    sock = stalled_stream(server.url, "/v1/chat/completions", body)
    try:
        engine = server.state.engine
        while engine.in_flight < N and time.monotonic() - started < 10:  # its N choices are admitted one by one
            time.sleep(0.02)
        assert engine.in_flight == N, "the stream started"
        while engine.in_flight and time.monotonic() - started < 10:
            time.sleep(0.05)
        freed_after = time.monotonic() - started
        assert engine.in_flight == 0, "the stalled stream still holds its slot"
        # the buffers fill within a few steps, the timeout then ends it: long before max_tokens would
        assert freed_after < SEND_TIMEOUT_S + 4, freed_after
        assert metric(server, "simple_serve_cancellations_total") == N  # counted as a client that left
        assert metric(server, 'simple_serve_generations_finished_total{reason="length"}') == lengths_before
    finally:
        sock.close()
    # and the server serves the next stream as usual
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={**body, "max_tokens": 3, "n": 1, "inspect": None}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
