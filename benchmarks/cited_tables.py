"""Tables whose cells are sentences with figures in them: the docs' summaries, and older measurements that no
bench writes in its own keys (a micro-benchmark's timings, the load-time prepack measurement, a range over runs).

A `cited` result file (docs/results/cited-*.json) holds the table's head and rows. A cell is plain text, or
`{"text": "... {} ...", "figures": [...]}` where each `{}` takes one figure, in order. A figure is either
`{"from": "other.json", "key": "a/b/c", "format": "{:.2f}x"}` (optionally `"scale"`, a unit change), read from
another result file, so a figure that a
bench's JSON holds is written down once, or `{"value": 1.07, "format": "{:.2f}x"}`, a figure that no other file
holds (an earlier run the README cited, say), kept here with its own format so it prints as it was stated.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.cells import markdown, provenance

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def figure(spec: dict, results: Path) -> str:
    if "from" in spec:
        value = json.loads((results / spec["from"]).read_text())
        for part in spec["key"].split("/"):
            value = value[int(part)] if isinstance(value, list) else value[part]
    else:
        value = spec["value"]
    if "scale" in spec:  # a unit change: ms kept, s printed
        value = value * spec["scale"]
    return spec.get("format", "{}").format(value)


def cell(spec: str | dict, results: Path) -> str:
    if isinstance(spec, str):
        return spec
    pieces = spec["text"].split("{}")
    if len(pieces) != len(spec["figures"]) + 1:
        raise ValueError(f"{spec['text']!r}: {len(pieces) - 1} places for {len(spec['figures'])} figures")
    values = [figure(f, results) for f in spec["figures"]] + [""]
    return "".join(piece + value for piece, value in zip(pieces, values))


def cited_table(runs: list[tuple[str, dict]], results: Path = RESULTS) -> str:
    blocks = []
    for name, r in runs:
        lines = markdown(r["head"], [[cell(c, results) for c in row] for row in r["rows"]]).splitlines()
        if r.get("align"):
            lines[1] = "| " + " | ".join(r["align"]) + " |"
        blocks.append("\n".join(lines))
    cited = sorted({f["from"] for _, r in runs for row in r["rows"] for c in row if isinstance(c, dict)
                    for f in c["figures"] if "from" in f})
    also = ("<br>\n<sub>Figures also read from " + ", ".join(f"[`{c}`](results/{c})" for c in cited) + ".</sub>"
            if cited else "")
    return "\n\n".join(blocks) + "\n\n" + provenance(runs) + also


TABLES = {"cited": cited_table}
