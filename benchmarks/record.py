"""What every bench's JSON carries besides its figures: the machine, the versions, the settings and the date.

A figure means little without the CPU it ran on (its model, and the instruction-set flags that decide our kernels),
the torch and transformers versions, the bench's own settings and when it ran: docs/performance.md compares runs
only with these at hand, and `make docs-figures` prints them under each table. `bench compare`, `bench shortcuts`
and `bench quality` start their report with `envelope(...)` and add their figures to it; the files transcribed
from the old README's tables (docs/results/) use the same keys, with only what the README stated.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
from pathlib import Path

SCHEMA = 1


def machine() -> dict:
    """CPU model, the flags torch and oneDNN may use, cores, RAM and GPU of this machine."""
    import psutil
    import torch

    from app.models.cpu import cpu_features

    cpu = cpu_features()
    return {"cpu": cpu.name, **cpuinfo_family(), "aten_capability": cpu.aten_capability, "flags": sorted(cpu.flags),
            "forced": list(cpu.forced), "cores": os.cpu_count(),
            "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "platform": platform.platform()}


def cpuinfo_family() -> dict:
    """x86's CPU family and model numbers (family 25 is Zen 3 / Zen 4, 26 Zen 5): VM CPU names often omit them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return {}
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    names = {"cpu family": "cpu_family", "model": "cpu_model"}
    return {names[k]: int(fields[k]) for k in names if fields.get(k, "").isdigit()}


def versions() -> dict:
    """Python, torch, transformers, simple-serve, and the git commit the code ran at (None outside a checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except OSError:
        commit = None
    return {"python": platform.python_version(), "torch": installed("torch"),
            "transformers": installed("transformers"), "simple-serve": installed("simple-serve"), "commit": commit}


def envelope(bench: str, args: argparse.Namespace) -> dict:
    """The head of a bench's JSON; the bench adds its figures after it."""
    settings = {k: v if isinstance(v, (str, int, float, bool, type(None))) else str(v) for k, v in vars(args).items()
                if not callable(v)}
    return {"schema": SCHEMA, "bench": bench, "source": f"python -m benchmarks {bench}",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": machine(), "versions": versions(), "settings": settings}
