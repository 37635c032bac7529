"""The compiled-grammar cache is per tenant wherever the prefix cache is (issue 45, finding 10): a schema another
API key compiled was a dict lookup, a new one a compile of tens of ms to seconds, so a tenant could tell by latency
which schemas the others used. Observed here by counting compiles, not by timing: each tenant's first use of a
schema compiles it, its second does not; with the keys sharing the prefix cache (PREFIX_CACHE_PER_KEY off) they
share grammars too. Compiles run in process here (`InProcessPool`), in place of the worker processes, which take
seconds to start."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

import app.structured.grammars as grammars_module
from app.structured.grammars import MAX_WHITESPACE, Grammars

KEYS = "key-of-tenant-a,key-of-tenant-b"
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}


class InProcessPool:
    """The compile pool's interface, compiling in this process (JSON schemas only) and counting what it compiles."""

    delay_s = 0.0
    compiled: list[str] = []

    def __init__(self, tokenizer_info_json: str, workers: int, memory_bytes: int):
        import xgrammar as xgr

        self._compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_info_json),
                                             cache_enabled=False)
        self._lock = threading.Lock()

    def compile(self, request: dict, timeout_s: float) -> str:
        with self._lock:
            InProcessPool.compiled.append(request["spec"])
        time.sleep(self.delay_s)
        return self._compiler.compile_json_schema(request["spec"], any_whitespace=True, strict_mode=False,
                                                  max_whitespace_cnt=MAX_WHITESPACE).serialize_json()

    def close(self) -> None:
        pass


@pytest.fixture
def in_process_compiles(monkeypatch) -> list[str]:
    monkeypatch.setattr(grammars_module, "CompilePool", InProcessPool)
    monkeypatch.setattr(InProcessPool, "compiled", [])
    return InProcessPool.compiled


def constrained_chat(server, key: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Where?"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                   timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.full
def test_a_schema_one_key_compiled_is_compiled_again_for_another_and_cached_for_each(make_tiny_server,
                                                                                      in_process_compiles):
    a, b = KEYS.split(",")
    server = make_tiny_server(api_key=KEYS)
    constrained_chat(server, a)
    assert len(in_process_compiles) == 1
    constrained_chat(server, b)  # a miss: B cannot learn that A sent this schema
    assert len(in_process_compiles) == 2
    constrained_chat(server, a)
    constrained_chat(server, b)  # each a hit in its own tenant's cache
    assert len(in_process_compiles) == 2


@pytest.mark.full
def test_with_the_prefix_cache_shared_across_keys_grammars_are_shared_too(make_tiny_server, in_process_compiles):
    a, b = KEYS.split(",")
    server = make_tiny_server(api_key=KEYS, prefix_cache_per_key=False)
    constrained_chat(server, a)
    constrained_chat(server, b)
    assert len(in_process_compiles) == 1


@pytest.mark.full
def test_a_compile_in_flight_is_shared_within_a_tenant_and_not_across(tiny_lm, in_process_compiles, monkeypatch):
    monkeypatch.setattr(InProcessPool, "delay_s", 0.3)
    grammars = Grammars(tiny_lm.tokenizer, tiny_lm.vocab_size, tiny_lm.eos_ids)

    async def scenario():
        same = [grammars.json_schema_async(SCHEMA, client=f"c{i}", tenant=tenant)
                for i, tenant in enumerate(["a", "a", "b"])]
        return await asyncio.gather(*same)

    try:
        a1, a2, b1 = asyncio.run(scenario())
    finally:
        grammars.close()
    assert a1 is a2 and b1 is not a1
    assert len(in_process_compiles) == 2
