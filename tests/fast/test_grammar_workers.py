"""A replaced grammar compile worker gives back everything it held (issue 45, finding 4): each kill at the compile
deadline left the dead process and its two pipes referenced by a finalizer for the server's life, so a client
whose schemas kept hitting the deadline ran the server out of descriptors. Counted in /proc/self/fd: the servers
of these tests run in the test's own process."""

from __future__ import annotations

import os
import sys

import httpx
import pytest

import app.structured.grammar_compile as grammar_compile
from app.structured.grammars import Grammars
from app.structured.schema_check import GrammarLimits
from app.errors import InvalidRequest

# A worker that starts in tens of ms rather than seconds (the real one imports xgrammar and torch): it speaks the
# real protocol up to a compile, which it never answers, so each compile is killed at its deadline.
NEVER_ANSWERS = r"""
import struct, sys, time
header = struct.Struct("<Q")
def read():
    (size,) = header.unpack(sys.stdin.buffer.read(header.size))
    return sys.stdin.buffer.read(size)
read()  # the tokenizer's tables
sys.stdout.buffer.write(header.pack(1) + b"\x00")
sys.stdout.buffer.flush()
read()  # a compile
time.sleep(600)
"""


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def zombie_children() -> list[str]:
    zombies = []
    with open(f"/proc/self/task/{os.getpid()}/children") as children:
        for pid in children.read().split():
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    if stat.read().rsplit(")", 1)[-1].split()[0] == "Z":
                        zombies.append(pid)
            except FileNotFoundError:  # reaped meanwhile
                pass
    return zombies


def schema(i: int) -> dict:
    return {"type": "object", "properties": {f"field_{i}": {"type": "integer"}}, "required": [f"field_{i}"]}


@pytest.mark.full
def test_fifty_compile_deadline_kills_in_a_row_leave_the_servers_descriptors_as_they_were(make_tiny_server,
                                                                                           monkeypatch):
    monkeypatch.setattr(grammar_compile, "WORKER_COMMAND", (sys.executable, "-S", "-c", NEVER_ANSWERS))
    server = make_tiny_server(grammar_compile_timeout_s=0.05)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "JSON"}], "max_tokens": 4}

    def refused_at_the_deadline(client: httpx.Client, i: int) -> None:
        r = client.post("/v1/chat/completions", json=dict(body, guided_json=schema(i)))
        assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_too_complex", r.text
        assert "GRAMMAR_COMPILE_TIMEOUT_S" in r.json()["error"]["message"]

    with httpx.Client(base_url=server.url, timeout=60) as client:
        refused_at_the_deadline(client, -1)  # the grammar tables, the connection: what stays open whatever follows
        before = open_descriptors()
        for i in range(50):
            refused_at_the_deadline(client, i)
        after = open_descriptors()
    assert abs(after - before) <= 2, (before, after)
    assert server.state.serving.grammars.compiles == 51  # each one reached a worker, distinct schemas: none cached


@pytest.mark.full
def test_the_real_worker_killed_at_its_deadline_is_reaped_and_its_pipes_closed(tiny_lm):
    grammars = Grammars(tiny_lm.tokenizer, tiny_lm.vocab_size, tiny_lm.eos_ids,
                        limits=GrammarLimits(compile_timeout_s=0.001))
    try:
        kills = 0
        for i in range(40):  # a compile on the tiny vocabulary may beat even 1 ms; most do not
            try:
                grammars.json_schema(schema(i))
            except InvalidRequest as err:
                assert err.code == "grammar_too_complex"
                kills += 1
                if kills == 1:
                    before = open_descriptors()
                elif kills == 3:
                    break
        assert kills == 3
        assert abs(open_descriptors() - before) <= 2  # each kill left two pipes before
        assert not zombie_children()
    finally:
        grammars.close()
