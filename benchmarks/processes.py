"""The servers a bench starts as processes of their own: a free loopback port for each, and a stop that waits."""

from __future__ import annotations

import itertools
import os
import random
import socket
import subprocess

# Ports for the servers tests and benches start, below Linux's ephemeral range (32768 and up), where no outbound
# connection is ever given a port. Each pytest-xdist worker takes its own block: a port from bind(0) goes back to the
# kernel when the probe closes, and a server that loads for seconds before it binds could lose it to another worker's
# server, then the first one's readiness poll would be answered by the wrong server (a CI run saw exactly that).
FIRST_PORT, BLOCK = 20000, 800
_candidates: itertools.cycle | None = None


def free_port() -> int:
    """A loopback port nothing listens on now, from this process's own block when running under pytest-xdist."""
    global _candidates
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.removeprefix("gw").isdigit():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    low = FIRST_PORT + int(worker.removeprefix("gw")) % 15 * BLOCK
    if _candidates is None:
        start = random.randrange(BLOCK)     # a rerun right after does not meet the last run's closing sockets
        _candidates = itertools.cycle([low + (start + i) % BLOCK for i in range(BLOCK)])
    for port in itertools.islice(_candidates, BLOCK):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue                    # taken, or still in TIME_WAIT from a server this worker stopped
            return port
    raise RuntimeError(f"no free loopback port in {low}-{low + BLOCK - 1}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 30 s (our server drains first)."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
