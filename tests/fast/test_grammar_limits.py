"""One request's grammar can hurt only that request: dead ends end it alone, costly schemas are refused or stopped,
and the cache never hands one schema another's grammar. On the tiny model, through the engine and the HTTP API."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from app.structured.grammars import Grammars, library_message
from app.core.engine.engine import Engine
from app.core.sampling import SamplingParams
from app.structured.schema_check import GrammarLimits, check_schema, pattern_repeat
from app.errors import InvalidRequest

DEAD_END = {"type": "string", "pattern": "[^\\s\\S]"}  # compiles; after the opening quote nothing may follow


def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("pattern, repeat", [
    ("abc", 1), ("a{0,50}", 50), ("(a|b){0,5000}", 5000), ("((a{0,30}){0,30}){0,30}", 27000), ("a{7}", 7),
    ("a{3,}", 3), ("[{0,99}]x", 1), ("\\{0,99}", 1), ("\\\\{0,99}", 99), ("(ab)*c+", 1), ("(a{0,10})(b{0,20})", 30),
    ("[a-z]{0,1000}" * 200, 200_000), ("(a{0,5}|b{0,5}){0,10}", 100),
])
def test_pattern_repeat_multiplies_nested_bounds_and_adds_sequential_ones(pattern, repeat):
    assert pattern_repeat(pattern) == repeat


@pytest.mark.parametrize("schema, where", [
    ({"type": "string", "pattern": "(a|b){0,20000}"}, "/pattern"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "((a{0,30}){0,30}){0,30}"}}},
     "/properties/s/pattern"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 100000}, "/minItems"),
])
def test_large_repetition_bounds_are_refused_naming_where(schema, where):
    with pytest.raises(InvalidRequest) as err:
        check_schema(schema, "response_format")
    assert where in err.value.message and "GRAMMAR_MAX_REPEAT" in err.value.message
    assert err.value.param == "response_format" and err.value.code == "grammar_too_complex"


def test_deep_nesting_is_refused_and_the_limit_is_a_setting():
    check_schema(nested_arrays(32), "response_format")
    with pytest.raises(InvalidRequest) as err:
        check_schema(nested_arrays(600), "response_format")
    assert "GRAMMAR_MAX_DEPTH" in err.value.message and err.value.code == "grammar_too_complex"
    with pytest.raises(InvalidRequest):
        check_schema(nested_arrays(5), "response_format", limits=GrammarLimits(max_depth=4))


@pytest.mark.full
def test_a_compile_past_its_deadline_is_stopped_and_the_next_compile_works(tiny_lm):
    grammars = Grammars(tiny_lm.tokenizer, tiny_lm.vocab_size, tiny_lm.eos_ids,
                        limits=GrammarLimits(compile_timeout_s=0.3))
    try:
        grammars.json_schema({"type": "object"})  # starts the worker, outside any deadline
        costly = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                             "required": [f"k{i}"]} for i in range(500)]}  # 47 s on Qwen's vocabulary
        started = time.monotonic()
        with pytest.raises(InvalidRequest) as err:
            grammars.json_schema(costly, param="tools.0.function.parameters")
        assert time.monotonic() - started < 5
        assert err.value.param == "tools.0.function.parameters" and "GRAMMAR_COMPILE_TIMEOUT_S" in err.value.message
        assert grammars.json_schema({"type": "array"}).matcher() is not None  # a fresh worker took over
    finally:
        grammars.close()


@pytest.mark.full
def test_the_librarys_source_path_and_timestamp_never_reach_the_caller(tiny_lm):
    grammars = Grammars(tiny_lm.tokenizer, tiny_lm.vocab_size, tiny_lm.eos_ids)
    try:
        with pytest.raises(InvalidRequest) as err:
            grammars.json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})
    finally:
        grammars.close()
    assert "response_format" in err.value.message
    assert ".cc:" not in err.value.message and not re.search(r"\[\d\d:\d\d:\d\d\]", err.value.message)
    assert library_message(RuntimeError("[17:50:01] /project/cpp/json_schema_converter.cc:123: bad ref x")) == \
        "bad ref x"


async def _collect(handle):
    tokens = []
    try:
        async for event in handle:
            tokens.append(event.token_id)
    except InvalidRequest as err:
        return tokens, err
    return tokens, None


@pytest.mark.full
def test_a_dead_end_grammar_ends_only_its_own_request(tiny_lm):
    """Two innocent neighbours, greedy and seeded-sampled, give the same tokens with the attacker batched in."""
    grammars = Grammars(tiny_lm.tokenizer, tiny_lm.vocab_size, tiny_lm.eos_ids)
    dead_end = grammars.json_schema(DEAD_END)
    grammars.close()
    prompt = tiny_lm.encode_chat([{"role": "user", "content": "Hello there"}])
    innocent = [SamplingParams(max_tokens=24, do_sample=False, ignore_eos=True),
                SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)]

    async def run(with_attacker: bool):
        engine = Engine(tiny_lm, max_active=4)
        engine.start()
        await asyncio.to_thread(engine.loaded.wait)
        try:
            handles = [engine.submit(prompt, p) for p in innocent]
            if with_attacker:
                handles.append(engine.submit(prompt, SamplingParams(max_tokens=24, grammar=dead_end,
                                                                    temperature=1.0, seed=1)))
            return await asyncio.gather(*(_collect(h) for h in handles))
        finally:
            engine.stop()

    alone = asyncio.run(run(False))
    together = asyncio.run(run(True))
    assert [tokens for tokens, _ in together[:2]] == [tokens for tokens, _ in alone] and len(alone[0][0]) == 24
    assert all(err is None for _, err in together[:2])
    tokens, err = together[2]
    assert tokens == [] or len(tokens) == 1  # the opening quote may be written; then nothing can follow
    assert err.param == "response_format" and err.code == "grammar_dead_end" and err.status == 400


@pytest.mark.full
def test_a_dead_end_over_http_is_a_400_or_an_error_event_and_neighbours_finish(make_tiny_server):
    server = make_tiny_server()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEAD_END}}}
    plain = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        answer = client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "grammar_dead_end"
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2].removeprefix("data: "))["error"]["param"] == "response_format"
        assert client.post("/v1/chat/completions", json=plain).json()["choices"][0]["finish_reason"] == "length"


def test_n_choices_one_fails_siblings_tasks_end(tiny_lm, monkeypatch):
    """n=2, non-streamed: choice 1 fails mid-generation; the request fails with its error, and neither choice's
    task is left pending (they used to leak until garbage collection logged "Task was destroyed")."""
    from types import SimpleNamespace

    import app.core.generate as generate_module
    from app.openai.serving import CompletionServing

    real_pick = generate_module.Sequence.pick

    def pick(self, logits):
        if self.params.seed == 8 and self.n_generated >= 2:
            raise InvalidRequest("simulated failure of choice 1", param="response_format")
        return real_pick(self, logits)

    monkeypatch.setattr(generate_module.Sequence, "pick", pick)

    async def scenario():
        engine = Engine(tiny_lm, max_active=4)
        engine.start()
        await asyncio.to_thread(engine.loaded.wait)
        serving = CompletionServing(engine, tiny_lm, "tiny")
        try:
            prompt = tiny_lm.encode_text("Hello there")
            choices = serving._submit(prompt, [SamplingParams(max_tokens=200, temperature=1.0, seed=s,
                                                              ignore_eos=True) for s in (7, 8)], None)

            async def connected():
                return False

            request = SimpleNamespace(is_disconnected=connected, state=SimpleNamespace())
            with pytest.raises(InvalidRequest, match="simulated"):
                await serving.collect(choices, request)
            await asyncio.sleep(0.5)  # the engine drops the cancelled sibling at its next step
            return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        finally:
            engine.stop()
            serving.grammars.close()

    assert asyncio.run(scenario()) == []


@pytest.mark.full
def test_compiles_of_one_schema_are_shared_and_waiting_compiles_are_bounded(tiny_lm, monkeypatch):
    from app.structured.grammar_compile import CompilePool
    from app.errors import Overloaded

    compiled = []
    real = CompilePool.compile

    def slow_compile(self, request, timeout_s):
        compiled.append(request["spec"])
        time.sleep(0.5)
        return real(self, request, timeout_s)

    monkeypatch.setattr(CompilePool, "compile", slow_compile)
    grammars = Grammars(tiny_lm.tokenizer, tiny_lm.vocab_size, tiny_lm.eos_ids, limits=GrammarLimits(queue=1, per_client=8))

    async def scenario():
        same = {"type": "object", "properties": {"a": {"type": "integer"}}}
        first = [asyncio.ensure_future(grammars.json_schema_async(same)) for _ in range(3)]
        other = asyncio.ensure_future(grammars.json_schema_async({"type": "array"}))
        await asyncio.sleep(0.1)
        with pytest.raises(Overloaded):  # one compiling, one waiting: a third distinct schema is a 429
            await grammars.json_schema_async({"type": "string"})
        results = await asyncio.gather(*first, other)
        return results

    try:
        results = asyncio.run(scenario())
    finally:
        grammars.close()
    assert results[0] is results[1] is results[2] and results[3] is not results[0]
    assert len(compiled) == 2  # the shared schema compiled once


@pytest.mark.full
def test_a_dead_end_through_the_responses_api_names_its_own_field(make_tiny_server):
    """The same dead end reached through Responses' text.format is named `text.format`, not the chat field."""
    server = make_tiny_server()
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 16,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": DEAD_END}}}
    answer = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "text.format"
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["type"] == "error" and events[-1]["param"] == "text.format"
    assert events[-1]["code"] == "grammar_dead_end"
