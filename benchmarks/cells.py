"""The cells and frame every docs table shares: a figure in ms or as a ratio, a TTFT cell, the markdown table, and
the provenance lines under it (which file, which CPU, when, from what command).

The table modules (figures.py, run_tables.py, cited_tables.py, goal_tables.py) all build on these, and figures.py
gathers their kinds, so imports run one way: cells <- the table modules <- figures <- docs.
"""

from __future__ import annotations

import json
from pathlib import Path

DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def load(results_dir: Path, names: list[str]) -> list[tuple[str, dict]]:
    return [(name, json.loads((results_dir / name).read_text())) for name in names]


def provenance(runs: list[tuple[str, dict]]) -> str:
    lines = []
    for name, r in runs:
        m = r.get("machine") or {}
        cpu = m.get("cpu", "CPU not recorded") + (f", {m['cores']} cores" if m.get("cores") else "")
        lines.append(f"[`{name}`](results/{name}): {cpu}; {r.get('date') or 'date not recorded'}; "
                     f"source: {r.get('source', 'not recorded')}.")
    return "\n".join(f"<sub>{line}</sub><br>" if i < len(lines) - 1 else f"<sub>{line}</sub>"
                     for i, line in enumerate(lines))


def ms(seconds: float | None, digits: int = 0) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.{digits}f} ms"


def ratio(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}x"


def ttft_cell(entry: dict | None) -> str:
    """A crashed server's cell says so and holds no figure, so it cannot read as a win."""
    if not entry:
        return "-"
    if "crashed" in entry:
        return "crashed"
    p50, tokens = entry["ttft_s"]["p50"], entry.get("prompt_tokens")
    if p50 is None:
        return f"- ({entry['errors']['count']} errors)"
    return ms(p50) + (f" ({tokens:,.0f})" if tokens is not None else "")


def markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
