"""Bodies that cost too much to parse are refused cheaply, by name, on every JSON route: nesting past MAX_JSON_DEPTH,
NaN and infinities, too many messages / items / blocks / tools, too many requests being parsed at once (issue 34)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

import app.api

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
# every JSON route, with a small valid body
ROUTES = {CHAT: {"model": "tiny", "messages": HI, "max_tokens": 1},
          "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 1},
          "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 1},
          "/v1/messages": {"model": "tiny", "messages": HI, "max_tokens": 1},
          "/v1/messages/count_tokens": {"model": "tiny", "messages": HI},
          "/tokenize": {"prompt": "hi"},
          "/detokenize": {"tokens": [1, 2]}}


def post_raw(server, path: str, text: str) -> httpx.Response:
    return httpx.post(server.url + path, content=text.encode(), headers={"content-type": "application/json"},
                      timeout=60)


def error_of(path: str, r: httpx.Response) -> tuple[str, str | None]:
    """(message, param) from OpenAI's error shape, or Anthropic's on /v1/messages (which has no param)."""
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return body["error"]["message"], None
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]["message"], body["error"]["param"]


@pytest.fixture(scope="module")
def server(tiny_lm):
    from app.config import Settings
    from app.main import create_app
    from conftest import ThreadServer

    with ThreadServer(create_app(Settings(model="tiny"), lm=tiny_lm)) as running:
        yield running


def test_every_route_still_serves_its_small_body(server):
    for path, body in ROUTES.items():
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 200, (path, r.text)


def test_600_nested_arrays_get_a_400_naming_the_depth_limit_on_every_route(server):
    deep = "[" * 600 + "1" + "]" * 600  # inside the body's own object: 601 levels
    for path, body in ROUTES.items():
        text = json.dumps({**body, "metadata": "X"}).replace('"X"', deep)
        r = post_raw(server, path, text)
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        message, _ = error_of(path, r)
        assert "601 levels" in message and "MAX_JSON_DEPTH" in message, (path, message)
    # brackets inside strings are text, not nesting: a prompt of 600 "[" is fine
    r = httpx.post(server.url + "/tokenize", json={"prompt": "[" * 600 + '\\"[' * 50})
    assert r.status_code == 200, r.text


def test_nesting_in_a_tool_use_input_or_a_tool_schema_gets_the_depth_400_not_a_500(server):
    # before: Anthropic's tool_use.input 600 deep was a RecursionError in json.dumps (a 500, and 0.5 MB of log)
    deep = "[" * 600 + "]" * 600
    turns = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"x": "X"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]
    text = json.dumps({"model": "tiny", "max_tokens": 1, "messages": turns}).replace('"X"', deep)
    r = post_raw(server, "/v1/messages", text)
    assert r.status_code == 400 and "MAX_JSON_DEPTH" in error_of("/v1/messages", r)[0], r.text[:300]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": "X"}}}
    text = json.dumps({"model": "tiny", "max_tokens": 1, "messages": HI, "tools": [tool]}).replace('"X"', deep)
    r = post_raw(server, CHAT, text)
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_too_deep", r.text[:300]


@pytest.mark.full
@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_get_a_400_on_every_route(server, constant):
    for path, body in ROUTES.items():
        text = json.dumps({**body, "metadata": {"x": "X"}}).replace('"X"', constant)
        r = post_raw(server, path, text)
        assert r.status_code == 400, (path, constant, r.status_code, r.text[:300])
        message, _ = error_of(path, r)
        assert constant in message and "not a JSON number" in message, (path, message)
    # where the parsed value would have gone straight into the answer: the Responses echo and a sampling field
    text = json.dumps({"model": "tiny", "input": "hi", "temperature": "X", "max_output_tokens": 1})
    assert post_raw(server, "/v1/responses", text.replace('"X"', constant)).status_code == 400


@pytest.mark.full
def test_too_many_messages_items_blocks_and_tools_are_refused_by_name(server):
    many = [{"role": "user", "content": ""}] * 2049
    cases = [(CHAT, {"model": "tiny", "messages": many}, "messages", "MAX_MESSAGES"),
             ("/tokenize", {"messages": many}, "messages", "MAX_MESSAGES"),
             ("/v1/responses", {"model": "tiny", "input": many}, "input", "MAX_MESSAGES"),
             (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 8193}]},
              "messages.0.content", "MAX_CONTENT_BLOCKS"),
             (CHAT, {"model": "tiny", "messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}] * 129},
              "tools", "MAX_TOOLS"),
             ("/detokenize", {"tokens": [1] * 257}, "tokens", "context window")]
    for path, body, param, limit in cases:
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 400, (path, param, r.text[:300])
        message, got = error_of(path, r)
        assert got == param and limit in message, (path, got, message)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):  # Anthropic's shape, the limit in the message
        r = httpx.post(server.url + path, json={"model": "tiny", "max_tokens": 1, "messages": many}, timeout=60)
        assert r.status_code == 400 and "MAX_MESSAGES" in error_of(path, r)[0], r.text[:300]
    # at the limit: served (empty user turns are a valid, if odd, conversation)
    r = httpx.post(server.url + "/tokenize", json={"messages": many[:2048]}, timeout=60)
    assert r.status_code == 200, r.text[:300]


def test_a_body_that_is_not_json_gets_a_400(server):
    for content, kind in ((b"model=tiny", "application/x-www-form-urlencoded"), (b'{"model": ', "application/json"),
                          (b"", "application/json"), ('{"prompt": "é"}'.encode("latin-1"), "application/json")):
        r = httpx.post(server.url + "/tokenize", content=content, headers={"content-type": kind})
        assert r.status_code == 400 and r.json()["error"]["message"], (content, r.text)


@pytest.fixture
def blocked_parses(monkeypatch):
    """Every body parse waits until `release` is set; `started` counts the parses that began."""
    release, started, real = threading.Event(), [], app.api.parse_body

    def slow(*args):
        started.append(time.monotonic())
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(app.api, "parse_body", slow)
    yield release, started
    release.set()


def test_past_max_preparing_a_429_with_retry_after_in_each_api_shape(make_tiny_server, blocked_parses):
    release, started = blocked_parses
    server = make_tiny_server(max_preparing=2, prepare_workers=1)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(client.post, "/tokenize", json={"prompt": "hi"}) for _ in range(2)]
            deadline = time.monotonic() + 10
            while server.state.preparing.pending < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            r = client.post(CHAT, json=ROUTES[CHAT])
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "rate_limit_exceeded" and "MAX_PREPARING" in r.json()["error"]["message"]
            r = client.post("/v1/messages", json=ROUTES["/v1/messages"])
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error", r.text
            assert len(started) == 1  # one worker: the second request waits, the third never got in
            release.set()
            assert [f.result().status_code for f in waiting] == [200, 200]
    assert server.state.preparing.pending == 0


@pytest.mark.full
def test_a_request_whose_client_left_while_queued_is_never_parsed(make_tiny_server, blocked_parses):
    release, started = blocked_parses
    server = make_tiny_server(prepare_workers=1)
    first = threading.Thread(target=httpx.post, args=(server.url + "/tokenize",), kwargs={
        "json": {"prompt": "hi"}, "timeout": 60})
    first.start()
    while not started:
        time.sleep(0.01)
    with pytest.raises(httpx.TimeoutException):  # queued behind the first, then gone
        httpx.post(server.url + "/tokenize", json={"prompt": "bye"}, timeout=0.3)
    time.sleep(0.5)  # the server notices within its poll interval
    release.set()
    first.join()
    deadline = time.monotonic() + 5
    while server.state.preparing.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(started) == 1 and server.state.preparing.pending == 0
    assert httpx.post(server.url + "/tokenize", json={"prompt": "hi"}).status_code == 200


def test_the_openapi_schema_still_shows_every_body(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    for path in ROUTES:
        operation = schema["paths"][path]["post"]
        ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.rsplit("/", 1)[1] in schema["components"]["schemas"], path
    assert schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]["enum"] == ["tiny"]


def test_a_client_gone_halfway_through_its_body_is_a_499_not_a_500(make_tiny_server):
    # before: starlette's ClientDisconnect from request.body() was an unhandled error, a 500 and its traceback
    import socket

    server = make_tiny_server()
    body = json.dumps(ROUTES[CHAT]).encode()
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) + 100}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(head + body)  # 100 bytes short
        time.sleep(0.3)  # the route is waiting for the rest
    deadline, metrics = time.monotonic() + 10, ""
    while 'status="499"' not in metrics and time.monotonic() < deadline:
        time.sleep(0.05)
        metrics = httpx.get(server.url + "/metrics").text
    assert f'endpoint="{CHAT}",status="499"' in metrics and 'status="500"' not in metrics


@pytest.mark.parametrize("chunk", [pytest.param(5, marks=pytest.mark.full), 64, 1 << 16])  # 5: 3 s on a Zen 3
def test_json_shape_reads_depth_and_list_lengths_as_the_parser_would_across_chunk_edges(monkeypatch, chunk):
    # json_shape reads the raw bytes CHUNK at a time; with small chunks every escape, string and key crosses an edge
    import random

    import app.body

    monkeypatch.setattr(app.body, "CHUNK", chunk)
    rng = random.Random(chunk)
    pieces = ["[", "]", "{", "}", ",", '"', "\\", '\\"', "\\\\", "a", ":", " ", "é", "😀"]

    def value(depth: int):
        roll = rng.random()
        if depth > 5 or roll < 0.3:
            return rng.choice([1, 2.5, None, "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))])
        if roll < 0.65:
            return [value(depth + 1) for _ in range(rng.randint(0, 6))]
        return {"".join(rng.choice('ab[,"\\') for _ in range(rng.randint(1, 3))): value(depth + 1)
                for _ in range(rng.randint(0, 6))}

    def nesting(v, depth: int = 0) -> int:
        inner = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        return depth if inner is None else max([depth + 1, *(nesting(x, depth + 1) for x in inner)])

    for _ in range(200):
        body = {key: value(1) for key in rng.sample(["messages", "tools", "input", "x"], rng.randint(0, 4))}
        raw = json.dumps(body, ensure_ascii=rng.random() < 0.5).encode()
        long = {key: len(v) for key, v in body.items() if isinstance(v, (list, dict)) and len(v) > 2}
        assert app.body.json_shape(raw, 2) == (nesting(body), long), raw
