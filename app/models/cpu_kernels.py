"""Our C++ CPU kernels, compiled with torch's `cpp_extension` on first use on a machine and loaded from
~/.cache/simple-serve/kernels/ after (cpp_extension rebuilds when a source changes, and locks its folder against a
second process building at the same time). Each kernel compiles its paths for their own instructions (target
attributes), so one build serves every x86 CPU and the path is chosen at run time from what the CPU has
(`cpu_features`, which honours ATEN_CPU_CAPABILITY). Where a build fails (no compiler, no ninja), the caller keeps
its torch version and says why."""

from __future__ import annotations

import functools
import hashlib
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from app.models.cpu import cpu_features

log = logging.getLogger("app.models.cpu_kernels")

BUILDS = Path.home() / ".cache" / "simple-serve" / "kernels"


@functools.cache
def build(name: str, source: Path, includes: tuple[Path, ...] = ()) -> tuple[Any, str | None]:
    """The compiled `source` as module `name`, or None and why not. cpp_extension rebuilds when a source changes,
    not a file it includes: the module's name carries a digest of `includes`, so a changed one is a new build."""
    if includes:
        digest = hashlib.sha256(b"".join(path.read_bytes() for path in includes)).hexdigest()[:10]
        name = f"{name}_{digest}"
    try:
        from torch.utils.cpp_extension import load

        folder = BUILDS / f"torch-{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}"
        folder.mkdir(parents=True, exist_ok=True)
        _drop_stale_lock(folder / "lock")
        started = time.perf_counter()
        # -fopenmp: at::parallel_for is inline OpenMP, serial without it; it joins torch's own libgomp at run time
        module = load(name=name, sources=[str(source)], extra_cflags=["-O3", "-fopenmp"],
                      extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
        log.info("%s ready in %.1f s (%s)", source.name, time.perf_counter() - started, folder)
        return module, None
    except Exception as err:  # noqa: BLE001 - no compiler, no ninja, a failed build: the torch version instead
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return None, f"{source.name} could not be built ({type(err).__name__}: {first[:200]})"


# A build takes about a minute (36-46 s with g++ 12 on a Zen 4); a lock this old was left by a process that died
# while building (killed, or its machine stopped), and cpp_extension would wait for it forever.
STALE_LOCK_S = 900


def _drop_stale_lock(lock: Path) -> None:
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return  # no lock: nobody is building
    if age > STALE_LOCK_S:
        log.warning("%s is %.0f s old: a build that died left it; removing it", lock, age)
        lock.unlink(missing_ok=True)


@dataclass(frozen=True)
class CpuKernel:
    """A kernel choice: a path of one of our extensions (a name in `PATHS`), or torch's own op, and why."""

    name: str
    why: str
    module: Any = None
    PATHS: ClassVar[dict[str, int]] = {}  # path name -> the extension's path number

    @property
    def ours(self) -> bool:
        return self.name in self.PATHS


def open_path(setting: str, asked: str, name: str, paths: dict[str, int], extension: Callable[[], tuple],
              labels: dict[str, str]) -> tuple[Any, str]:
    """(the extension, why path `name` runs) for `setting`=`asked`, or (None, why it cannot: no build, or a CPU
    without the path's instructions)."""
    cpu = cpu_features()
    module, why = extension()
    if module is None or not module.supported(paths[name]):
        return None, why or f"{setting}={asked}, but cpu {cpu.describe()} lacks its instructions"
    return module, f"{labels[name]} on cpu {cpu.describe()}" + ("" if asked == "auto" else f", {setting}={asked}")
