"""Issue 58, finding 5: POST /v1/files checks who sent an upload before it reads the body, takes a body past
MAX_REQUEST_BYTES only where the Files API is on, streams the file to disk and back, and holds each key to its
quotas of files, bytes and result rows, with a 400 naming the setting.

Raw sockets where the point is what the server does before a body arrives: an HTTP client sends the whole body
before it reads an answer, which would hide whether the server waited for it."""

from __future__ import annotations

import hashlib
import io
import json
import socket
import time
import tracemalloc
from urllib.parse import urlsplit

import httpx
import openai
import pytest

MiB = 2**20
BOUNDARY = "test-boundary-58"


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def chat_line(i: int) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": f"count to {i}"}], "max_tokens": 4}}


def raw_post(url: str, headers: dict[str, str], body: bytes = b"", timeout: float = 5) -> tuple[int, dict, bytes]:
    """Send the headers and `body` (perhaps far less than the content-length they declare), then read until the
    server closes the connection: (status, headers, body). A server that waited for the rest would time out."""
    parts = urlsplit(url)
    head = f"POST {parts.path} HTTP/1.1\r\nhost: {parts.hostname}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(head.encode() + body)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, payload = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    return int(status_line.split()[1]), {k.lower(): v.strip() for k, v in (l.split(":", 1) for l in lines)}, payload


def multipart_head(purpose: str = "batch", filename: str = "in.jsonl") -> bytes:
    return (f"--{BOUNDARY}\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\n{purpose}\r\n"
            f"--{BOUNDARY}\r\ncontent-disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n"
            "content-type: application/jsonl\r\n\r\n").encode()


MULTIPART_TAIL = f"\r\n--{BOUNDARY}--\r\n".encode()
FORM = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}


def streamed_upload(size: int, purpose: str = "user_data", chunk: int = MiB):
    """A multipart body whose file is `size` bytes of JSONL-ish text, made as it is sent (the test holds none of
    it), and its length."""
    line = b'{"n": "' + b"x" * 1000 + b'"}\n'
    head = multipart_head(purpose, "big.jsonl")

    def body():
        yield head
        left = size
        block = line * (chunk // len(line) + 1)
        while left:
            yield block[:min(left, chunk)]
            left -= min(left, chunk)
        yield MULTIPART_TAIL

    expected = hashlib.sha256()
    block, left = line * (chunk // len(line) + 1), size
    while left:
        expected.update(block[:min(left, chunk)])
        left -= min(left, chunk)
    return body, len(head) + size + len(MULTIPART_TAIL), expected.hexdigest()


def files_on_disk(batch_dir) -> list[str]:
    return sorted(p.name for p in (batch_dir / "files").iterdir())


# ---- the key before the body ----

@pytest.mark.full
def test_a_100_mib_upload_without_a_key_is_a_401_before_its_body_is_read(make_tiny_server, tmp_path):
    server = make_tiny_server(batch_dir=tmp_path / "batches", api_key="key-a")
    for key in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
        # 100 MiB declared, 200 bytes sent: an answer at all (within raw_post's 5 s) says the server did not wait
        status, headers, body = raw_post(f"{server.url}/v1/files",
                                         {**FORM, **key, "content-length": str(100 * MiB)}, multipart_head())
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        assert headers["connection"] == "close"  # and nothing drains the 100 MiB it refused
    # a client that waits for `100 Continue` (curl does, past 1 MiB) gets its 401 and never sends the body
    status, headers, _ = raw_post(f"{server.url}/v1/files",
                                  {**FORM, "content-length": str(100 * MiB), "expect": "100-continue"})
    assert status == 401
    assert files_on_disk(tmp_path / "batches") == []
    # the right key's upload of the same form goes through
    r = httpx.post(f"{server.url}/v1/files", headers={"authorization": "Bearer key-a"},
                   files={"file": ("in.jsonl", jsonl([chat_line(1)]))}, data={"purpose": "batch"})
    assert r.status_code == 200, r.text


@pytest.mark.full
def test_without_batch_dir_an_upload_has_the_ordinary_body_limit(make_tiny_server):
    server = make_tiny_server()  # MAX_REQUEST_BYTES: 1 MiB
    status, headers, body = raw_post(f"{server.url}/v1/files", {**FORM, "content-length": str(2 * MiB)},
                                     multipart_head())
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert headers["connection"] == "close"
    r = httpx.post(f"{server.url}/v1/files", files={"file": ("in.jsonl", jsonl([chat_line(1)]))},
                   data={"purpose": "batch"})
    assert r.status_code == 404 and "BATCH_DIR" in r.json()["error"]["message"]


# ---- streamed both ways ----

@pytest.mark.full
def test_a_big_upload_and_its_download_are_streamed_not_held_in_memory(make_tiny_server, tmp_path):
    server = make_tiny_server(batch_dir=tmp_path / "batches", api_key="key-a")
    key = {"authorization": "Bearer key-a"}
    body, length, digest = streamed_upload(48 * MiB)
    tracemalloc.start()  # the server runs in this process: its allocations are traced too
    try:
        r = httpx.post(f"{server.url}/v1/files", content=body(),
                       headers={**key, **FORM, "content-length": str(length)}, timeout=60)
        assert r.status_code == 200, r.text
        _, upload_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        got = hashlib.sha256()
        with httpx.stream("GET", f"{server.url}/v1/files/{r.json()['id']}/content", headers=key,
                          timeout=60) as download:
            assert download.headers["content-length"] == str(48 * MiB)
            for chunk in download.iter_raw():
                got.update(chunk)
        _, download_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.json()["bytes"] == 48 * MiB and got.hexdigest() == digest
    assert upload_peak < 12 * MiB and download_peak < 12 * MiB, (upload_peak, download_peak)
    assert files_on_disk(tmp_path / "batches") == [f"{r.json()['id']}.jsonl"]  # no `.partial` left


@pytest.mark.full
def test_the_sdk_uploads_and_downloads_as_before(make_tiny_server, tmp_path):
    server = make_tiny_server(batch_dir=tmp_path / "batches", api_key="key-a")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-a")
    data = jsonl([chat_line(i) for i in range(20)])
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    assert (uploaded.filename, uploaded.bytes, uploaded.purpose) == ("in.jsonl", len(data), "batch")
    assert client.files.content(uploaded.id).content == data
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="nonsense")


@pytest.mark.full
@pytest.mark.parametrize("body, param", [
    (multipart_head("batch") + b'{"custom_id": 1\n' + MULTIPART_TAIL, "file"),  # not a batch input
    (multipart_head("nonsense") + b"x" + MULTIPART_TAIL, "purpose"),
    (multipart_head("batch") + jsonl([chat_line(1)]), "file"),  # cut before its closing boundary
    (f"--{BOUNDARY}\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{BOUNDARY}--\r\n".encode(),
     "file"),  # no file
    (f"--{BOUNDARY}\r\ncontent-disposition: form-data; name=\"file\"; filename=\"a\"\r\n\r\n".encode()
     + jsonl([chat_line(1)]) + MULTIPART_TAIL, "purpose"),  # no purpose
    (b"not multipart at all", "file"),
], ids=["not-a-batch-input", "unknown-purpose", "cut-short", "no-file", "no-purpose", "not-multipart"])
def test_a_broken_upload_is_a_400_naming_the_field_and_leaves_nothing(make_tiny_server, tmp_path, body, param):
    server = make_tiny_server(batch_dir=tmp_path / "batches")
    r = httpx.post(f"{server.url}/v1/files", content=body, headers=FORM)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert str(tmp_path) not in r.text  # no server path in an error
    assert files_on_disk(tmp_path / "batches") == []


@pytest.mark.full
def test_a_full_disk_is_a_507_naming_the_cause_not_the_path(make_tiny_server, tmp_path, monkeypatch):
    import errno
    import os

    from app.batch.uploads import Upload

    def disk_full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))

    monkeypatch.setattr(Upload, "write", disk_full)
    server = make_tiny_server(batch_dir=tmp_path / "batches")
    r = httpx.post(f"{server.url}/v1/files", files={"file": ("in.jsonl", jsonl([chat_line(1)]))},
                   data={"purpose": "batch"})
    assert r.status_code == 507 and "No space left on device" in r.json()["error"]["message"]
    assert str(tmp_path) not in r.text and "/" not in r.json()["error"]["message"]
    assert files_on_disk(tmp_path / "batches") == []


# ---- quotas ----

@pytest.mark.full
def test_a_key_past_its_file_count_gets_a_400_naming_the_setting(make_tiny_server, tmp_path):
    server = make_tiny_server(batch_dir=tmp_path / "batches", api_key="key-a,key-b", batch_max_files_per_key=2)
    a = openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-a", max_retries=0)
    b = openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-b", max_retries=0)
    data = jsonl([chat_line(1)])
    first = a.files.create(file=("1.jsonl", data), purpose="batch")
    a.files.create(file=("2.jsonl", data), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        a.files.create(file=("3.jsonl", data), purpose="batch")
    error = refused.value.body
    assert error["code"] == "files_quota_exceeded" and "BATCH_MAX_FILES_PER_KEY" in error["message"]
    assert str(tmp_path) not in error["message"]
    assert b.files.create(file=("1.jsonl", data), purpose="batch")  # the other key's quota is its own
    a.files.delete(first.id)
    assert a.files.create(file=("3.jsonl", data), purpose="batch")  # room again


@pytest.mark.full
def test_a_key_past_its_stored_bytes_gets_a_400_naming_the_setting(make_tiny_server, tmp_path):
    server = make_tiny_server(batch_dir=tmp_path / "batches", api_key="key-a,key-b",
                              batch_max_stored_bytes_per_key=10_000)
    a, b = {"authorization": "Bearer key-a"}, {"authorization": "Bearer key-b"}
    data = jsonl([chat_line(i) for i in range(40)])  # about 6 KB
    assert 5_000 < len(data) < 10_000
    url = f"{server.url}/v1/files"
    assert httpx.post(url, headers=a, files={"file": ("1.jsonl", data)}, data={"purpose": "batch"}).status_code == 200
    # the second one passes the quota mid-stream: sent chunked, its length is not known before
    chunked = httpx.post(url, headers={**a, **FORM},
                         content=iter([multipart_head(), data[:3000], data[3000:], MULTIPART_TAIL]))
    assert chunked.status_code == 400, chunked.text
    error = chunked.json()["error"]
    assert error["code"] == "bytes_quota_exceeded" and "BATCH_MAX_STORED_BYTES_PER_KEY" in error["message"]
    # one whose declared length is past what is left is refused before its body is read
    status, headers, body = raw_post(url, {**a, **FORM, "content-length": str(MiB)}, multipart_head())
    assert status == 400 and json.loads(body)["error"]["code"] == "bytes_quota_exceeded"
    assert headers["connection"] == "close"
    assert str(tmp_path) not in chunked.text + body.decode()
    assert httpx.post(url, headers=b, files={"file": ("1.jsonl", data)}, data={"purpose": "batch"}).status_code == 200
    assert len(files_on_disk(tmp_path / "batches")) == 2  # the refused uploads left nothing


@pytest.mark.full
def test_a_batch_past_the_keys_result_rows_gets_a_400_naming_the_setting(make_tiny_server, tmp_path):
    server = make_tiny_server(batch_dir=tmp_path / "batches", api_key="key-a,key-b",
                              batch_max_result_rows_per_key=30)
    a = openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-a", max_retries=0)
    b = openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-b", max_retries=0)
    twenty = jsonl([chat_line(i) for i in range(20)])
    first = a.files.create(file=("in.jsonl", twenty), purpose="batch")
    a.batches.create(input_file_id=first.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError) as refused:  # 20 retained + 20 new > 30, finished or not
        a.batches.create(input_file_id=first.id, endpoint="/v1/chat/completions", completion_window="24h")
    error = refused.value.body
    assert error["code"] == "result_rows_quota_exceeded" and "BATCH_MAX_RESULT_ROWS_PER_KEY" in error["message"]
    other = b.files.create(file=("in.jsonl", twenty), purpose="batch")
    assert b.batches.create(input_file_id=other.id, endpoint="/v1/chat/completions", completion_window="24h")


def test_check_result_rows_refuses_a_batch_past_the_quota_naming_the_setting(tmp_path):
    from app.auth import ApiKeys
    from app.batch.service import BatchService
    from app.batch.store import Store
    from app.batch.uploads import QuotaExceeded
    from app.config import Settings

    store = Store(tmp_path / "batches")
    settings = Settings(model="tiny", batch_dir=tmp_path / "batches", batch_max_result_rows_per_key=300)
    service = BatchService(store, None, settings, ApiKeys(None), ["/v1/chat/completions"])
    service.check_result_rows("", 300)  # exactly the quota
    store.add_batch(owner="", endpoint="/v1/chat/completions", input_file_id="file-x", completion_window="24h",
                    total=200, expires_at=int(time.time()) + 60, metadata=None, max_in_progress=8)
    service.check_result_rows("", 100)
    service.check_result_rows("someone-else", 300)  # another owner's batches are not counted
    with pytest.raises(QuotaExceeded) as refused:
        service.check_result_rows("", 101)
    assert refused.value.status == 400 and refused.value.code == "result_rows_quota_exceeded"
    assert "BATCH_MAX_RESULT_ROWS_PER_KEY" in refused.value.message and str(tmp_path) not in refused.value.message
    store.close()


def test_a_half_written_upload_left_by_a_crash_is_removed_at_start(tmp_path):
    from app.batch.store import Store

    Store(tmp_path / "batches").close()
    (tmp_path / "batches" / "files" / "file-abc.partial").write_bytes(b"half")
    Store(tmp_path / "batches").close()
    assert files_on_disk(tmp_path / "batches") == []


def test_the_openapi_schema_describes_the_upload_form(tiny_lm, tmp_path):
    from app.config import Settings
    from app.main import create_app

    app = create_app(Settings(model="tiny", batch_dir=tmp_path / "batches"), lm=tiny_lm)
    body = app.openapi()["paths"]["/v1/files"]["post"]["requestBody"]
    schema = body["content"]["multipart/form-data"]["schema"]
    assert body["required"] and schema["required"] == ["file", "purpose"]
    assert schema["properties"]["file"]["format"] == "binary"
    app.state.serve.batch_store.close()
