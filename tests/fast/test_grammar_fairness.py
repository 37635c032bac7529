"""One client cannot monopolise structured outputs: schema sizes add up (within a pattern, over a schema, over a
request's tools) and are refused past a bound, a compile's memory is capped, and compiles are bounded and served in
turn per client, so another client's schema waits for at most one of the greedy client's compiles. The last test
is the issue's: an innocent json_schema request beside one client's 9 hostile schemas, on a live server."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from app.structured.grammars import Grammars
from app.structured.fair_queue import FairQueue
from app.structured.grammar_compile import CompilePool
from app.structured.schema_check import GrammarLimits, check_schema
from app.errors import InvalidRequest, Overloaded
from app.openai.structured import forced_tool_tag
from app.openai.tools.wire import Tool
from conftest import serve_process

OR_1000 = {"type": "string", "pattern": "(a|b){0,1000}"}


def hostile_schema(tag: str) -> dict:
    """The issue's: 20 properties of `(a|b){0,1000}` (1.3 KB; 6.6 s to compile on Qwen's vocabulary, 15 s here on
    the tiny one); `tag` makes each one distinct, so none is a cache hit."""
    return {"type": "object", "properties": {f"p{i}_{tag}": OR_1000 for i in range(20)},
            "required": [f"p{i}_{tag}" for i in range(20)]}


def refused(schema, limits: GrammarLimits = GrammarLimits()) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        check_schema(schema, "response_format", limits=limits)
    assert err.value.param == "response_format" and err.value.code == "grammar_too_complex"
    return err.value


def test_sequential_repetitions_in_one_pattern_add_up():
    """200 `[a-z]{0,1000}` in one 3 KB pattern made a 26.9 MB grammar; each bound alone is within the limit."""
    err = refused({"type": "string", "pattern": "[a-z]{0,1000}" * 200})
    assert "200,000" in err.message and "GRAMMAR_MAX_REPEAT" in err.message


def test_repetitions_add_up_over_the_whole_schema_and_over_a_requests_tools():
    check_schema({"type": "object", "properties": {f"p{i}": OR_1000 for i in range(4)}}, "response_format")
    err = refused(hostile_schema("x"))
    assert "GRAMMAR_MAX_TOTAL_REPEAT" in err.message and "/properties/p4_x/pattern" in err.message
    tools = [Tool.model_validate({"type": "function", "function": {
        "name": f"f{i}", "parameters": {"type": "object", "properties": {"s": OR_1000}}}}) for i in range(5)]
    forced_tool_tag("hermes", tools[:4], True, GrammarLimits())  # 4,000: at the bound
    with pytest.raises(InvalidRequest) as err:
        forced_tool_tag("hermes", tools, True, GrammarLimits())
    assert err.value.param == "tools.4.function.parameters" and "GRAMMAR_MAX_TOTAL_REPEAT" in err.value.message


def test_large_enums_are_refused_by_count_and_by_bytes():
    """An enum of 20,000 strings (509 KB) drove the compile worker to 1.9 GiB."""
    err = refused({"type": "string", "enum": [f"option-number-{i:06d}-abc" for i in range(20000)]})
    assert "GRAMMAR_MAX_ENUM_VALUES" in err.message and "20,000" in err.message
    err = refused({"type": "object", "properties": {"a": {"enum": ["x" * 20000]}, "b": {"const": "y" * 20000}}})
    assert "GRAMMAR_MAX_LITERAL_BYTES" in err.message and "/properties/b/const" in err.message
    check_schema({"enum": [f"v{i}" for i in range(1000)]}, "response_format")


@pytest.mark.full
def test_a_compile_past_its_memory_limit_is_a_400_and_a_fresh_worker_takes_the_next(tiny_lm):
    grammars = Grammars(tiny_lm.tokenizer, tiny_lm.vocab_size, tiny_lm.eos_ids,
                        limits=GrammarLimits(memory_bytes=256 * 2**20, compile_timeout_s=60))
    try:
        grammars.json_schema({"type": "object"})  # starts the worker
        costly = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                             "required": [f"k{i}"]} for i in range(500)]}  # past 256 MiB in 9 s here
        with pytest.raises(InvalidRequest) as err:
            grammars.json_schema(costly)
        assert err.value.code == "grammar_too_complex" and "GRAMMAR_COMPILE_MEMORY_BYTES" in err.value.message
        assert grammars.json_schema({"type": "array"}).matcher() is not None
    finally:
        grammars.close()


def test_the_fair_queue_serves_clients_in_turn():
    queue = FairQueue(1)
    release, order = threading.Event(), []

    def job(name: str) -> str:
        release.wait(10)
        order.append(name)
        return name

    try:
        futures = [queue.submit("greedy", job, f"greedy{i}") for i in range(3)]
        futures.append(queue.submit("other", job, "other"))
        release.set()
        assert [f.result(10) for f in futures] == ["greedy0", "greedy1", "greedy2", "other"]
    finally:
        queue.shutdown()
    assert order == ["greedy0", "other", "greedy1", "greedy2"]  # after one greedy job, the other client's


@pytest.mark.full
def test_one_clients_compiles_are_bounded_and_another_client_is_not(tiny_lm, monkeypatch):
    real = CompilePool.compile
    monkeypatch.setattr(CompilePool, "compile", lambda self, request, timeout_s: (
        time.sleep(0.5), real(self, request, timeout_s))[1])
    grammars = Grammars(tiny_lm.tokenizer, tiny_lm.vocab_size, tiny_lm.eos_ids, limits=GrammarLimits(per_client=2))

    async def scenario():
        mine = [asyncio.ensure_future(grammars.json_schema_async({"type": "object", "title": f"t{i}"},
                                                                 client="greedy")) for i in range(2)]
        await asyncio.sleep(0.1)
        with pytest.raises(Overloaded) as err:
            await grammars.json_schema_async({"type": "object", "title": "third"}, client="greedy")
        assert "GRAMMAR_COMPILE_PER_CLIENT" in err.value.message
        other = await grammars.json_schema_async({"type": "array"}, client="other")
        return await asyncio.gather(*mine), other

    try:
        (first, second), other = asyncio.run(scenario())
    finally:
        grammars.close()
    assert first is not second and other.matcher() is not None


# ---- live server ----

CHAT = "/v1/chat/completions"


def schema_chat(schema: dict, max_tokens: int = 16) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": max_tokens,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                        "schema": schema}}}


def innocent_schema(tag: str) -> dict:
    return {"type": "object", "title": tag, "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"]}


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    """A server process whose clients are told apart by a header (as a trusted proxy in front would set it)."""
    log = tmp_path_factory.mktemp("fairness") / "serve.log"
    with serve_process(tiny_dir, log, env={"SERVED_MODEL_NAME": "tiny", "GRAMMAR_CLIENT_HEADER": "x-client"}) as url:
        yield url


def timed_post(url: str, body: dict, client: str) -> tuple[int, float, dict]:
    started = time.perf_counter()
    answer = httpx.post(url + CHAT, json=body, headers={"x-client": client}, timeout=300)
    return answer.status_code, time.perf_counter() - started, answer.json()


@pytest.mark.server
@pytest.mark.alone
def test_an_innocent_schema_beside_one_clients_nine_hostile_ones_takes_at_most_twice_its_time_alone_plus_half_a_second(server):
    """The issue's repro: before, the innocent request got a 429 at once, and a 200 only after 57 s (2.7 s alone)."""
    timed_post(server, schema_chat(innocent_schema("warm-up")), "innocent")  # the compile worker has started
    # 64 tokens: long enough alone (about 0.5 s here) that the bound is not all noise on a shared machine
    alone = min(timed_post(server, schema_chat(innocent_schema(f"alone{i}"), 64), "innocent")[1] for i in range(2))
    with ThreadPoolExecutor(10) as pool:
        attacks = [pool.submit(timed_post, server, schema_chat(hostile_schema(f"h{i}")), "greedy") for i in range(9)]
        time.sleep(0.3)  # the hostile schemas have arrived
        status, beside, body = timed_post(server, schema_chat(innocent_schema("beside"), 64), "innocent")
        hostile = [f.result() for f in attacks]
    print(f"innocent json_schema request: {alone:.2f} s alone, {beside:.2f} s beside 9 hostile schemas")
    assert status == 200, body
    # Twice its time alone, plus half a second: on 2 cores the 9 hostile requests' parsing and refusals share the
    # CPU with it (CI saw 0.15 s alone, 0.31 s beside). Waiting behind one hostile compile, the failure this guards
    # against, costs seconds (15 s each on this vocabulary), far past the bound.
    assert beside <= 2 * alone + 0.5, (alone, beside)
    for code, _, answer in hostile:  # each one a clear 4xx, never a 5xx
        assert code in (400, 429) and answer["error"]["message"], answer


@pytest.mark.server
def test_another_client_waits_for_at_most_one_of_a_greedy_clients_slow_compiles(server):
    """Schemas that pass the static bounds and still compile slowly: the greedy client gets GRAMMAR_COMPILE_PER_CLIENT
    (2) of them at once and a 429 for the rest, and the other client's schema is compiled next, before the greedy
    client's second."""
    slow = [{"anyOf": [{"type": "object", "properties": {f"k{i}_{n}": {"type": "integer"}}, "required": [f"k{i}_{n}"]}
                       for i in range(60)]} for n in range(9)]
    finished: list[str] = []

    def post(body: dict, client: str, name: str):
        result = timed_post(server, body, client)
        finished.append(name)
        return result

    with ThreadPoolExecutor(10) as pool:
        attacks = [pool.submit(post, schema_chat(schema), "greedy", f"greedy{n}") for n, schema in enumerate(slow)]
        time.sleep(0.3)
        status, _, body = post(schema_chat(innocent_schema("next")), "innocent", "innocent")
        hostile = [f.result() for f in attacks]
    assert status == 200, body
    codes = sorted(code for code, _, _ in hostile)
    assert codes.count(429) == 7 and all(code in (200, 400) for code in codes[:2]), codes
    accepted = [name for name in finished if name.startswith("greedy") and
                hostile[int(name[6:])][0] != 429]
    assert finished.index("innocent") < finished.index(accepted[-1]), finished
