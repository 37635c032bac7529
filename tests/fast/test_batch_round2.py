"""Batch jobs and tenants, round 2 (issue 58): each finding the review made, reproduced, on the tiny model.

A transient error is never a line's answer; batch lines are the engine's background class, which never turns a user's
request into a 429 and keeps a share of the slots; `priority` below 0 needs the operator's grant; JSONL splits at
`\\n` only; the completion window is bounded; cancel stops lines in flight; an input file in use is kept; the
output files of a batch finalized twice are the same files; concurrent creates respect BATCH_MAX_IN_PROGRESS; the
offline command takes neither the server's key nor its directory.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from collections import deque

import httpx
import openai
import pytest

from test_batch_api import chat_line, jsonl, wait_done

from app.batch.lines import check_file, iter_lines
from app.batch.runner import BatchRunner, window_seconds
from app.batch.store import QuotaRefused, Store
from app.core.engine.engine import Engine
from app.core.engine.handle import RequestHandle, next_to_admit
from app.core.sampling import SamplingParams
from app.entry import Answer, Caller
from app.errors import Overloaded


# ---- the engine's priority classes ----

def handle(background: bool, priority: int = 0) -> RequestHandle:
    return RequestHandle("r", [1], SamplingParams(priority=priority), 1, asyncio.new_event_loop(),
                         background=background)


def test_a_waiting_batch_line_takes_its_share_of_slots_ahead_of_queued_users_and_no_more():
    users, line = [handle(False) for _ in range(3)], handle(True)
    waiting = deque([*users, line])
    assert next_to_admit(waiting, background_running=0, batch_slots=1) is line  # its share: one slot
    assert next_to_admit(waiting, background_running=1, batch_slots=1) is users[0]  # share taken: users first
    assert next_to_admit(waiting, background_running=0, batch_slots=0) is users[0]  # no share: idle slots only


def test_batch_lines_wait_behind_users_and_never_make_a_user_request_a_429(tiny_lm):
    async def main():
        engine = Engine(tiny_lm, max_active=1, max_queue=2)
        engine.start()
        await asyncio.to_thread(engine.loaded.wait)
        try:
            params = SamplingParams(max_tokens=2, do_sample=False)
            lines = [engine.submit([1, 2, 3], params, background=True) for _ in range(3)]  # the engine is full
            users = [engine.submit([1, 2, 3], params) for _ in range(3)]  # and users still get all of theirs
            with pytest.raises(Overloaded):  # users count against max_queue among themselves
                engine.submit([1, 2, 3], params)
            assert [h.background for h in engine._waiting][:2] == [False, False]  # users queue ahead of lines
            for h in users + lines:
                assert [e async for e in h]
        finally:
            engine.stop()
    asyncio.run(main())


# ---- priority: lowering is free, raising needs the operator's grant ----

def test_a_negative_priority_needs_priority_keys_and_the_responses_api_passes_priority_on(make_tiny_server):
    server = make_tiny_server(api_key="key-a,key-b", priority_keys="key-a")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for key, priority, status in (("key-b", -2**31, 403), ("key-b", 5, 200), ("key-a", -2**31, 200)):
        r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "priority": priority},
                       headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == status, r.text
        if status == 403:
            assert r.json()["error"]["param"] == "priority" and "PRIORITY_KEYS" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 2,
                                                        "priority": -1}, headers={"Authorization": "Bearer key-b"})
    assert r.status_code == 403 and r.json()["error"]["param"] == "priority"


def test_batch_lines_of_every_endpoint_run_in_the_background_class(make_tiny_server, tmp_path):
    server = make_tiny_server(batch_dir=tmp_path / "batches")
    engine = server.state.engine
    seen: list[bool] = []
    submit = engine.submit
    engine.submit = lambda *a, **k: (seen.append(k.get("background", False)), submit(*a, **k))[1]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    line = {"custom_id": "r1", "method": "POST", "url": "/v1/responses",
            "body": {"model": "tiny", "input": "hello", "max_output_tokens": 2}}
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([line]))), purpose="batch")
    batch = wait_done(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/responses",
                                                    completion_window="24h").id)
    assert batch.request_counts.completed == 1 and seen == [True]
    httpx.post(f"{server.url}/v1/responses", json=line["body"], timeout=30)
    assert seen == [True, False]  # the same body over HTTP: interactive


# ---- input files ----

def test_a_line_holding_u2028_is_valid_jsonl_and_its_answer_survives_a_resume(tmp_path):
    path = tmp_path / "in.jsonl"
    line = json.dumps(chat_line(1, messages=[{"role": "user", "content": "first\u2028second\u0085third"}]),
                      ensure_ascii=False)
    path.write_bytes((line + "\r\n" + json.dumps(chat_line(2)) + "\n").encode())
    assert check_file(path, None, 10) == ("/v1/chat/completions", 2)
    [first, _] = list(iter_lines(path, None))
    assert first.body["messages"][0]["content"] == "first\u2028second\u0085third"


@pytest.mark.parametrize("window, seconds", [("24h", 86400), ("999999999999999d", None), ("366d", None),
                                             ("0s", None), ("7d", 7 * 86400)])
def test_the_completion_window_is_bounded(window, seconds):
    assert window_seconds(window) == seconds


def test_a_huge_completion_window_is_a_400_not_a_500(make_tiny_server, tmp_path):
    server = make_tiny_server(batch_dir=tmp_path / "batches")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line(1)]))), purpose="batch")
    r = httpx.post(f"{server.url}/v1/batches", json={"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions",
                                                      "completion_window": "999999999999999d"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "completion_window"


@pytest.mark.full  # the batch must still run when the delete comes: 40 answers, 7 s on a Zen 3
def test_an_input_file_in_use_is_kept_until_its_batch_ends(make_tiny_server, tmp_path):
    server = make_tiny_server(batch_dir=tmp_path / "batches", batch_concurrency=1)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(
        [chat_line(i, max_tokens=32, ignore_eos=True) for i in range(40)]))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="input of batch"):
        client.files.delete(uploaded.id)
    server.state.batch_store.forget_before(int(time.time()) + 10)  # retention past it: still kept
    assert wait_done(client, batch.id).request_counts.completed == 40
    assert client.files.delete(uploaded.id).deleted


# ---- the runner ----

class FakeServe:
    """Answers a line with each status of `script` in turn, then 200."""

    def __init__(self, script: list[int]):
        self.script, self.calls = list(script), 0

    async def __call__(self, url, body, caller: Caller) -> Answer:
        self.calls += 1
        status = self.script.pop(0) if self.script else 200
        return Answer(status, json.dumps({"status": status}).encode(), caller.request_id)


def run_batch(tmp_path, serve, lines: int = 1, concurrency: int = 2, **runner):
    """The batch's row when the runner is done with it, and its counts."""
    store = Store(tmp_path / "batches")
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([chat_line(i) for i in range(lines)]))
    file_id = store.new_file_id()
    store.partial_path(file_id).write_bytes(path.read_bytes())
    store.add_file(file_id, "", "batch", "in.jsonl", path.stat().st_size)

    async def main():
        r = BatchRunner(store, serve, concurrency, 100, **runner)
        batch = store.add_batch("", "/v1/chat/completions", file_id, "24h", lines, int(time.time()) + 60, None, 8)
        r.start(batch["id"])
        await asyncio.sleep(0)
        await r.wait(batch["id"])
        return store.batch(batch["id"])
    try:
        batch = asyncio.run(main())
        return batch, store.counts(batch)
    finally:
        store.close()


def test_a_429_or_503_is_run_again_and_never_stored_as_the_lines_answer(tmp_path, monkeypatch):
    monkeypatch.setattr("app.batch.runner.RETRY_S", (0.01, 0.02))
    serve = FakeServe([503, 429, 503])
    batch, counts = run_batch(tmp_path, serve)
    assert serve.calls == 4 and batch["status"] == "completed"
    assert counts.completed == 1 and batch["error_file_id"] is None


def test_a_500_is_run_again_at_most_three_times_then_kept(tmp_path, monkeypatch):
    monkeypatch.setattr("app.batch.runner.RETRY_S", (0.01, 0.02))
    serve = FakeServe([500] * 10)
    batch, counts = run_batch(tmp_path, serve)
    assert serve.calls == 3 and counts.failed == 1


def test_while_draining_no_line_starts_and_a_503_leaves_no_row(tmp_path, monkeypatch):
    monkeypatch.setattr("app.batch.runner.RETRY_S", (0.01, 0.02))
    draining = threading.Event()

    class Drain(FakeServe):
        async def __call__(self, url, body, caller):
            draining.set()  # SIGTERM arrives while the first line runs; it is answered 503
            return await super().__call__(url, body, caller)

    serve = Drain([503])
    batch, counts = run_batch(tmp_path, serve, lines=5, concurrency=1, draining=draining.is_set)
    assert serve.calls == 1 and batch["status"] == "in_progress" and counts.completed == counts.failed == 0


def test_a_batch_finalized_twice_keeps_the_same_output_files(tmp_path):
    batch, _ = run_batch(tmp_path, FakeServe([]), lines=3)
    store = Store(tmp_path / "batches")
    try:
        again = store.write_outputs(store.batch(batch["id"]))  # a crash while finalizing, then a restart
        assert again == (batch["output_file_id"], None)
        assert len(store.files("", "batch_output")) == 1
        assert len(store.file_path(again[0]).read_text().splitlines()) == 3
        assert not list((tmp_path / "batches" / "files").glob("*.partial"))
        (tmp_path / "batches" / "files" / "file-unlisted.jsonl").write_text("{}\n")  # killed before its row
    finally:
        store.close()
    Store(tmp_path / "batches").close()  # the next start removes it
    assert not (tmp_path / "batches" / "files" / "file-unlisted.jsonl").exists()


def test_concurrent_creates_cannot_pass_batch_max_in_progress_together(tmp_path):
    store = Store(tmp_path / "batches")
    made: list = []
    try:
        def create():
            made.append(store.add_batch("owner", "/v1/chat/completions", "file-x", "24h", 1, 0, None, 3))
        threads = [threading.Thread(target=create) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(b is not None for b in made) == 3
        refused: list = []

        def create_rows():  # BATCH_MAX_RESULT_ROWS_PER_KEY: 5 requests, 2 a batch: two pass, whatever the timing
            try:
                made.append(store.add_batch("rows", "/v1/chat/completions", "file-x", "24h", 2, 0, None, 99, 5))
            except QuotaRefused as err:
                refused.append(err.used)
        threads = [threading.Thread(target=create_rows) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(refused) == 10 and set(refused) == {4}
    finally:
        store.close()


@pytest.mark.full
def test_cancel_stops_the_lines_in_flight_within_two_seconds(make_tiny_server, tmp_path, monkeypatch):
    import app.core.engine.step as step
    real = step.StepRunner.run_step
    monkeypatch.setattr(step.StepRunner, "run_step", lambda self, batch: (time.sleep(0.05), real(self, batch))[1])
    server = make_tiny_server(batch_dir=tmp_path / "batches", batch_concurrency=2)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(  # each line ~10 s at 50 ms a step
        [chat_line(i, max_tokens=200, ignore_eos=True) for i in range(4)]))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    while server.state.engine.in_flight < 2:
        time.sleep(0.02)
    started = time.monotonic()
    client.batches.cancel(batch.id)
    done = wait_done(client, batch.id, timeout=10)
    took = time.monotonic() - started
    assert done.status == "cancelled" and took < 2.0, took
    while server.state.engine.in_flight and time.monotonic() - started < 2.0:
        time.sleep(0.02)
    assert server.state.engine.in_flight == 0  # their slots given back too


# ---- the offline command ----

def test_resume_runs_again_the_lines_an_older_output_answered_with_a_retryable_error(tmp_path):
    from app.batch.cli import done_custom_ids

    out = tmp_path / "out.jsonl"
    records = [{"custom_id": c, "response": {"status_code": s, "body": {}}} for c, s in
               (("a", 200), ("b", 503), ("c", 400), ("d", 429), ("e", 500))]
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records) + '{"custom_id": "torn')
    assert done_custom_ids(out) == {"a", "c"}
    assert [json.loads(l)["custom_id"] for l in out.read_text().splitlines()] == ["a", "c"]
