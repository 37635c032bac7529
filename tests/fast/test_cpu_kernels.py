"""Our C++ kernels build under cpp_extension's lock file: one left by a build that died must not hold every later
start forever, and one of a build in progress must be respected."""

from __future__ import annotations

import os
import time

from app.models import cpu_kernels


def test_a_lock_left_by_a_dead_build_is_removed_and_a_fresh_one_kept(tmp_path, caplog):
    stale, fresh = tmp_path / "stale" / "lock", tmp_path / "fresh" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    old = time.time() - cpu_kernels.STALE_LOCK_S - 60
    os.utime(stale, (old, old))
    cpu_kernels._drop_stale_lock(stale)
    cpu_kernels._drop_stale_lock(fresh)
    cpu_kernels._drop_stale_lock(tmp_path / "none" / "lock")  # no lock at all: nothing to do
    assert not stale.exists() and fresh.exists()
    assert "a build that died left it" in caplog.text
