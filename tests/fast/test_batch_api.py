"""OpenAI's Files and Batches API on the tiny model, driven by the openai SDK as its users drive it: upload a JSONL
file, create a batch, poll it, read the output file; and each line's answer equals the route's own for its body."""

from __future__ import annotations

import io
import json
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.full


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def chat_line(i: int, **body) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": f"count to {i}"}],
                     "max_tokens": 4, "temperature": 0, **body}}


def wait_done(client: openai.OpenAI, batch_id: str, timeout: float = 60) -> openai.types.Batch:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout} s")


def test_the_sdk_runs_a_batch_and_each_line_equals_the_routes_own_answer(make_tiny_server, tmp_path):
    server = make_tiny_server(batch_dir=tmp_path / "batches")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    lines = [chat_line(i) for i in range(200)] + [chat_line(999, max_tokens=-1)]  # the last one: a 400 from the route
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "test"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "test"}
    batch = wait_done(client, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (201, 200, 1)
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert [o["custom_id"] for o in output] == [f"req-{i}" for i in range(200)]
    assert errors[0]["custom_id"] == "req-999" and errors[0]["response"]["status_code"] == 400
    assert errors[0]["response"]["body"]["error"]["param"] == "max_tokens"
    for line, out in list(zip(lines, output))[::20]:  # every 20th line asked again of the route itself
        direct = httpx.post(f"{server.url}/v1/chat/completions", json=line["body"], timeout=30).json()
        assert out["response"]["status_code"] == 200
        assert out["response"]["body"]["choices"] == direct["choices"]
        usage = {k: v for k, v in out["response"]["body"]["usage"].items() if k != "prompt_tokens_details"}
        assert usage == {k: v for k, v in direct["usage"].items() if k != "prompt_tokens_details"}  # cached differs
    listed = client.batches.list(limit=10)
    assert [b.id for b in listed.data] == [batch.id]
    metrics = httpx.get(f"{server.url}/metrics").text  # progress without ids or names
    assert 'simple_serve_batch_lines_total{result="ok"} 200.0' in metrics
    assert 'simple_serve_batch_lines_total{result="error"} 1.0' in metrics
    assert "simple_serve_batches_in_progress 0.0" in metrics and batch.id not in metrics


@pytest.mark.parametrize("lines, named", [
    ([chat_line(1), chat_line(1)], "line 2"),  # a duplicate custom_id
    ([chat_line(1), {**chat_line(2), "url": "/v1/completions"}], "line 2"),  # mixed urls
    ([chat_line(1, stream=True)], "line 1"),
    ([{"custom_id": "x", "method": "GET", "url": "/v1/chat/completions", "body": {}}], "line 1"),
])
def test_a_malformed_input_file_is_refused_naming_the_line(make_tiny_server, tmp_path, lines, named):
    server = make_tiny_server(batch_dir=tmp_path / "batches")
    r = httpx.post(f"{server.url}/v1/files", files={"file": ("in.jsonl", jsonl(lines))}, data={"purpose": "batch"})
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"] and r.json()["error"]["param"] == "file"


def test_not_jsonl_is_refused_at_upload(make_tiny_server, tmp_path):
    server = make_tiny_server(batch_dir=tmp_path / "batches")
    r = httpx.post(f"{server.url}/v1/files", files={"file": ("in.jsonl", b'{"custom_id": 1\n')},
                   data={"purpose": "batch"})
    assert r.status_code == 400 and "line 1" in r.json()["error"]["message"]


def test_another_key_gets_404_for_a_file_or_batch_it_did_not_create(make_tiny_server, tmp_path):
    server = make_tiny_server(batch_dir=tmp_path / "batches", api_key="key-a,key-b")
    a = openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-a")
    b = openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-b")
    uploaded = a.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line(1)]))), purpose="batch")
    batch = a.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: b.files.retrieve(uploaded.id), lambda: b.files.content(uploaded.id),
                 lambda: b.batches.retrieve(batch.id), lambda: b.batches.cancel(batch.id),
                 lambda: b.files.delete(uploaded.id),
                 lambda: b.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert b.batches.list().data == [] and b.files.list().data == []
    assert wait_done(a, batch.id).status == "completed"  # and the owner's lines ran as the owner
    assert a.batches.list().data[0].id == batch.id


def test_without_batch_dir_the_routes_say_how_to_turn_them_on(make_tiny_server):
    server = make_tiny_server()
    r = httpx.get(f"{server.url}/v1/batches")
    assert r.status_code == 404 and "BATCH_DIR" in r.json()["error"]["message"]


def test_a_cancelled_batch_stops_and_keeps_what_finished(make_tiny_server, tmp_path):
    server = make_tiny_server(batch_dir=tmp_path / "batches", batch_concurrency=1)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(
        [chat_line(i, max_tokens=64, ignore_eos=True) for i in range(200)]))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    while client.batches.retrieve(batch.id).request_counts.completed < 1:
        time.sleep(0.05)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_done(client, batch.id)
    assert done.status == "cancelled" and 1 <= done.request_counts.completed < 200
    output = client.files.content(done.output_file_id).text.splitlines()
    assert len(output) == done.request_counts.completed


def test_a_batch_past_its_window_expires_keeping_the_finished_lines(make_tiny_server, tmp_path):
    server = make_tiny_server(batch_dir=tmp_path / "batches", batch_concurrency=1)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(
        [chat_line(i, max_tokens=64, ignore_eos=True) for i in range(300)]))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="1s")
    done = wait_done(client, batch.id)
    assert done.status == "expired" and done.request_counts.completed < 300
    expired = [json.loads(l) for l in client.files.content(done.error_file_id).text.splitlines()]
    assert expired and all(e["error"]["code"] == "batch_expired" for e in expired)
    assert done.request_counts.completed + len(expired) == 300


def test_an_unwritable_batch_dir_is_refused_at_start_naming_it(tiny_lm, tmp_path):
    from app.config import Settings
    from app.errors import ConfigError
    from app.main import create_app

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="BATCH_DIR"):
        create_app(Settings(model="tiny", batch_dir=blocker / "batches"), lm=tiny_lm)


def test_the_sdk_runs_an_embedding_batch_equal_to_the_routes_answers(tmp_path):
    from embedding_models import build_tiny_bert_dir

    from app.config import Settings
    from app.main import create_app
    from app.models.loading import load_model
    from conftest import ThreadServer

    path = build_tiny_bert_dir(tmp_path / "bert")
    with ThreadServer(create_app(Settings(model=str(path), batch_dir=tmp_path / "batches"),
                                 lm=load_model(str(path), device="cpu"))) as server:
        model = server.state.settings.model_id
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": model, "input": f"sentence number {i} about Paris"}} for i in range(100)]
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="endpoint"):  # an embedding model serves no chat
            client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
        batch = wait_done(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                                        completion_window="24h").id)
        assert batch.status == "completed" and batch.request_counts.completed == 100
        output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
        for line, out in list(zip(lines, output))[::10]:
            direct = httpx.post(f"{server.url}/v1/embeddings", json=line["body"], timeout=30).json()
            assert out["custom_id"] == line["custom_id"]
            assert out["response"]["body"]["data"] == direct["data"]


def test_a_file_over_batch_max_file_bytes_is_a_413_naming_the_limit(make_tiny_server, tmp_path):
    server = make_tiny_server(batch_dir=tmp_path / "batches", batch_max_file_bytes=4096)
    r = httpx.post(f"{server.url}/v1/files", files={"file": ("in.jsonl", jsonl([chat_line(i) for i in range(50)]))},
                   data={"purpose": "batch"})
    assert r.status_code == 413 and "4096" in r.json()["error"]["message"]


def test_files_list_retrieve_and_delete(make_tiny_server, tmp_path):
    server = make_tiny_server(batch_dir=tmp_path / "batches")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line(1)]))), purpose="batch")
    assert client.files.retrieve(uploaded.id).filename == "in.jsonl"
    assert [f.id for f in client.files.list(purpose="batch").data] == [uploaded.id]
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
