"""The ports tests and benches give the servers they start: under pytest-xdist, each worker draws from a block of
its own, so a server that binds seconds after its port was picked cannot meet another worker's server there (a CI
run's readiness poll was once answered by another test's server on the same port)."""

import json
import os
import socket
import subprocess
import sys

from benchmarks.processes import BLOCK, FIRST_PORT


def ports_of(worker: str, count: int = 6, taken: int | None = None) -> list[int]:
    code = ("import json, socket\nfrom benchmarks.processes import free_port\n"
            "print(json.dumps([free_port() for _ in range(%d)]))" % count)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    if worker:
        env["PYTEST_XDIST_WORKER"] = worker
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_each_worker_draws_distinct_free_ports_from_its_own_block_below_the_ephemeral_range():
    first, second = ports_of("gw0"), ports_of("gw1")
    assert all(FIRST_PORT <= p < FIRST_PORT + BLOCK for p in first)
    assert all(FIRST_PORT + BLOCK <= p < FIRST_PORT + 2 * BLOCK for p in second)
    assert len(set(first)) == len(first)            # a bench that starts two servers gets two ports
    for port in first + second:                     # each was free when handed out
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_outside_pytest_xdist_the_kernel_picks_the_port():
    port = ports_of("", count=1)[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
