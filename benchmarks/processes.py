"""The servers a bench starts as processes of their own: a free loopback port for each, and a stop that waits."""

from __future__ import annotations

import socket
import subprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 30 s (our server drains first)."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
