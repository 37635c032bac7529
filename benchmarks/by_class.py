"""What each setting gives on each CPU class: the `bench scaling` runs of a class (docs/results/scaling-CLASS*.json)
merged into one figure set per model size and setting, and the tables docs/performance.md and the README print from
it. benchmarks/charts.py draws the class charts from the same `merge`, so a table and its chart cannot disagree.

A class's runs are read newest first: a size and setting take their speed figures (tokens/s at 1 and 8 streams,
first token) from the newest run that measured them, and their memory (resident after the first request, peak
VmHWM) from the newest run that recorded it, which may be a `--load-only` run that measured memory alone. Each row
names the run(s) it came from, with its date and commit. A class with no run says so, in words: no figure is
borrowed from another class.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from benchmarks.tables import CLASSES, SERVERS, markdown, mib, ms, provenance, rate

ORDER = ["ours", "ours-int8", "ours-int4", "ours-int4-copy", "ours-kv8", "ours-gguf", "llama.cpp-Q8_0", "llama.cpp-Q4_K_M"]


@dataclass
class Figures:
    """One size and setting on one class: speed from one run, memory from one run (maybe another)."""
    parameters: int
    speed: dict | None = None
    memory: dict | None = None
    runs: list[str] = field(default_factory=list)


def class_of(pattern: str) -> str:
    """`scaling-zen4*.json` -> `zen4`."""
    return re.sub(r"^scaling-|[*?].*$|\.json$", "", pattern)


def merge(runs: list[tuple[str, dict]]) -> dict[str, dict[str, Figures]]:
    """size -> setting -> Figures, sizes by parameter count and settings in ORDER."""
    merged: dict[str, dict[str, Figures]] = {}
    for name, r in sorted(runs, key=lambda run: run[1].get("date") or "", reverse=True):
        for size, entry in r["sizes"].items():
            for server, f in entry["servers"].items():
                figures = merged.setdefault(size, {}).setdefault(server, Figures(entry["parameters"]))
                took = False
                if figures.speed is None and "1 streams" in f:
                    figures.speed, took = f, True
                if figures.memory is None and f.get("memory_after_first_request"):
                    figures.memory, took = f["memory_after_first_request"], True
                if took and name not in figures.runs:
                    figures.runs.append(name)
    rank = {s: i for i, s in enumerate(ORDER)}
    return {size: dict(sorted(merged[size].items(), key=lambda kv: rank.get(kv[0], len(ORDER))))
            for size in sorted(merged, key=lambda s: next(iter(merged[s].values())).parameters)}


def _run_link(name: str, runs: dict[str, dict]) -> str:
    r = runs[name]
    commit = ((r.get("versions") or {}).get("commit") or "no commit")[:7]
    return f"[{str(r.get('date') or '?')[:10]}, {commit}](results/{name})"


def _speed(f: Figures, key: str) -> str:
    if f.speed is None:
        return "not measured"
    entry = f.speed.get(key) or {}
    return rate(entry.get("tokens_per_s")) if "tokens_per_s" in entry else "-"


def unmeasured(pattern: str) -> str:
    return (f"Unmeasured: docs/results/ holds no `bench scaling` run on this class yet (`{pattern}`). "
            "[How to measure it](benchmarking.md#what-to-set-on-a-cpu-class-bench-scaling).")


def class_table(pattern: str, runs: list[tuple[str, dict]]) -> str:
    """Per size and setting: tokens/s at 1 and 8 streams, idle first token (128-token prompt), resident and peak
    memory, and the run(s) it came from."""
    if not runs:
        return unmeasured(pattern)
    by_name, rows, used = dict(runs), [], set()
    for size, settings in merge(runs).items():
        for i, (server, f) in enumerate(settings.items()):
            ttft = (f.speed or {}).get("idle TTFT at 128 tokens", {}).get("ttft_p50_s")
            rows.append([size if i == 0 else "", SERVERS.get(server, server), _speed(f, "1 streams"),
                         _speed(f, "8 streams"), ms(ttft), mib((f.memory or {}).get("rss")),
                         mib((f.memory or {}).get("peak")), ", ".join(_run_link(n, by_name) for n in f.runs)])
            used.update(f.runs)
    head = ["model size", "setting", "tok/s, 1 stream", "tok/s, 8 streams", "first token (128-token prompt)",
            "resident", "peak", "run"]
    return markdown(head, rows) + "\n\n" + provenance([r for r in sorted(runs) if r[0] in used])


def best_of_ours(settings: dict[str, Figures]) -> tuple[str, Figures] | None:
    """Our setting with the most tokens/s at 1 stream at this size, or None if none was timed."""
    timed = [(s, f) for s, f in settings.items() if s.startswith("ours") and f.speed]
    return max(timed, key=lambda sf: sf[1].speed["1 streams"]["tokens_per_s"], default=None)


def summary_table(classes: list[tuple[str, list[tuple[str, dict]]]]) -> str:
    """The README's table: per class, the largest size timed, our fastest setting there against llama.cpp Q4_K_M
    (tokens/s at 1 / 8 streams) and its peak memory; a class with no timed run says it is unmeasured."""
    rows = []
    for pattern, runs in classes:
        name = CLASSES.get(class_of(pattern), class_of(pattern))
        link = f"[{name}](performance.md#{slug(name)})"
        timed = [(size, s) for size, s in merge(runs).items() if best_of_ours(s)] if runs else []
        if not timed:
            what = "memory only, speed unmeasured" if runs else "unmeasured"
            rows.append([link, what, "", "", "", ""])
            continue
        size, settings = timed[-1]
        server, f = best_of_ours(settings)
        peer = settings.get("llama.cpp-Q4_K_M")
        rows.append([link, size, SERVERS[server].removeprefix("simple-serve, "),
                     f"{_speed(f, '1 streams')} / {_speed(f, '8 streams')}",
                     f"{_speed(peer, '1 streams')} / {_speed(peer, '8 streams')}" if peer else "not run",
                     mib((f.memory or {}).get("peak"))])
    head = ["CPU class", "largest size timed", "our fastest setting", "its tok/s, 1 / 8 streams",
            "llama.cpp Q4_K_M, 1 / 8", "its peak memory"]
    return markdown(head, rows)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading (as tests/fast/test_docs.py computes it)."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
