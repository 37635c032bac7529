"""PNG charts for the docs, drawn with matplotlib from the bench JSON under docs/results/ (`make docs-figures`), through
the same readers as the tables (benchmarks/by_class.py), so a chart and its table cannot disagree.

- `scaling-CLASS.png`, one per CPU class with a timed `bench scaling` run: tokens/s at 1 and at 8 streams and peak
  memory against the model's size, one line a setting (docs/performance.md, under the class's table);
- `headline.png` (the README's one chart): tokens/s at 1 stream against size, one panel a class.
matplotlib's Agg backend draws the same pixels for the same data; the PNGs carry no timestamp, so an unchanged JSON
leaves an unchanged file.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.by_class import merge
from benchmarks.tables import CLASSES

SHORT = {"ours": "ours, defaults", "ours-int8": "ours int8", "ours-int4": "ours int4", "ours-int4-copy": "ours int4+copy",
         "llama.cpp-Q4_K_M": "llama.cpp Q4_K_M", "llama.cpp-Q8_0": "llama.cpp Q8_0"}
COLOURS = dict(zip(SHORT, ("C0", "C1", "C2", "C3", "C4", "C5")))  # a setting keeps its colour on every panel
# optimize: PIL writes the same pixels in fewer bytes (the headline chart had grown past the docs tests' size bound)
PNG = {"metadata": {"Software": None}, "dpi": 110, "pil_kwargs": {"optimize": True}}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def classes(results: Path) -> dict[str, dict]:
    """CPU class -> its merged figures, for each class with at least one timed size."""
    found = {}
    for key in CLASSES:
        runs = [(p.name, json.loads(p.read_text())) for p in sorted(results.glob(f"scaling-{key}*.json"))]
        merged = merge(runs) if runs else {}
        if any(f.speed for settings in merged.values() for f in settings.values()):
            found[key] = merged
    return found


def lines(ax, merged: dict, value, label: str) -> None:
    """One line a setting: `value(Figures)` against parameters in billions, sizes without it left out."""
    servers = dict.fromkeys(s for settings in merged.values() for s in settings)
    for server in servers:
        points = [(f.parameters / 1e9, value(f)) for settings in merged.values()
                  if (f := settings.get(server)) is not None and value(f)]
        if points:
            ax.plot([p for p, _ in points], [v for _, v in points], marker="o", label=SHORT.get(server, server),
                    color=COLOURS.get(server))
    ax.set_xlabel("parameters, billions")
    ax.set_ylabel(label)
    ax.set_ylim(bottom=0)
    if ax.lines:  # a panel with nothing measured (a run without 8 streams, say) gets no empty legend
        ax.legend(fontsize=7)


def tokens_per_s(streams: str):
    return lambda f: ((f.speed or {}).get(streams) or {}).get("tokens_per_s")


def draw_all(results: Path, out: Path) -> list[Path]:
    plt = _plt()
    out.mkdir(parents=True, exist_ok=True)
    found, written = classes(results), []
    for key, merged in found.items():
        fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
        lines(axes[0], merged, tokens_per_s("1 streams"), "tokens/s, 1 stream")
        lines(axes[1], merged, tokens_per_s("8 streams"), "tokens/s, 8 streams")
        lines(axes[2], merged, lambda f: (f.memory or {}).get("peak", 0) / 2**30, "peak memory, GiB")
        axes[0].set_title(CLASSES[key], fontsize=9)
        written.append(_save(fig, out / f"scaling-{key}.png"))
    if found:
        fig, axes = plt.subplots(1, len(found), figsize=(4.2 * len(found), 3.6), squeeze=False)
        for ax, (key, merged) in zip(axes[0], found.items()):
            lines(ax, merged, tokens_per_s("1 streams"), "tokens/s, 1 stream")
            ax.set_title(CLASSES[key], fontsize=9)
        fig.suptitle("Tokens/s at 1 stream against model size (Qwen2.5 shapes, no GPU): each setting, each CPU class",
                     fontsize=10)
        written.append(_save(fig, out / "headline.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, **PNG)
    _plt().close(fig)
    return path
