"""PNG charts for the docs, drawn with matplotlib from the bench JSON under docs/results/ (`make docs-figures`).

- `compare-*.json` with the five servers: aggregate tokens/s at 1 and N streams, one bar pair per server, one panel
  per run; `headline.png` (the README's one chart) puts every five-server run side by side.
- `shortcuts-*.json`: the prefix cache's warm/cold TTFT ratio and speculation's on/off decode ratios, per run.
- TTFT against prompt length (`ttft-by-prompt-length.png`) is drawn from any compare run that holds
  `ttft_by_prompt_len` (`bench compare --prompt-lens`): one line per server, one panel per run; no run under
  docs/results/ records it yet, so that chart is skipped and says so.
matplotlib's Agg backend draws the same pixels for the same data; the PNGs carry no timestamp, so an unchanged JSON
leaves an unchanged file.
"""

from __future__ import annotations

import json
from pathlib import Path

SHORT = {"ours": "ours", "ours-int8": "ours int8", "ours-int4": "ours int4", "ours-int4-copy": "ours int4+copy",
         "ours-compiled": "ours compiled", "ours-invariant": "ours invariant",
         "ours-variant": "ours variant", "llama.cpp": "llama.cpp", "transformers": "transformers",
         "transformers-cb": "transformers CB"}
PNG = {"metadata": {"Software": None}, "dpi": 110}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(report: dict) -> str:
    m = report.get("machine") or {}
    dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(report.get("dtype"), report.get("dtype"))
    dtype = f", {dtype}" if dtype else ""  # a bench that serves several dtypes (scaling) records none
    return f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores{dtype} ({(report.get('date') or '')[:10]})"


def streams_axes(ax, report: dict) -> None:
    scenarios = list(report["results"])[:2]
    kinds = list(report["results"][scenarios[0]])
    width = 0.38
    for i, scenario in enumerate(scenarios):
        rates = [report["results"][scenario].get(k, {}).get("output_tokens_per_s", {}).get("aggregate") or 0
                 for k in kinds]
        bars = ax.bar([x + (i - 0.5) * width for x in range(len(kinds))], rates, width, label=scenario)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(kinds)), [SHORT.get(k, k) for k in kinds], rotation=20, fontsize=8)
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title(_title(report), fontsize=9)
    ax.legend(fontsize=8)


def ttft_axes(ax, report: dict) -> None:
    """TTFT p50 against the requested prompt length, one line per server. Linear axes: prefill's cost grows about
    linearly with the prompt, so each line's slope is the server's prefill time per token. A crashed length draws
    no point (a failed request is no figure) and its server's legend says where it crashed."""
    for kind, entries in report["ttft_by_prompt_len"].items():
        points = sorted((int(n), e["ttft_s"]["p50"]) for n, e in entries.items()
                        if "crashed" not in e and e["ttft_s"]["p50"] is not None)
        crashed = sorted(int(n) for n, e in entries.items() if "crashed" in e)
        label = SHORT.get(kind, kind) + (f" (crashed at {crashed[0]:,})" if crashed else "")
        ax.plot([n for n, _ in points], [v * 1e3 for _, v in points], marker="o", label=label)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("prompt length, tokens (requested)")
    ax.set_ylabel("TTFT p50, ms (1 stream)")
    ax.set_title(_title(report), fontsize=9)
    ax.legend(fontsize=8)


def scaling_axes(axes, report: dict) -> None:
    """`bench scaling`: tokens/s at one and at eight streams, and resident memory, against the model's size, one line
    a server."""
    servers = dict.fromkeys(name for entry in report["sizes"].values() for name in entry["servers"])
    for name in servers:
        points = [(entry["parameters"] / 1e9, entry["servers"][name]) for entry in report["sizes"].values()
                  if name in entry["servers"] and "memory_after_first_request" in entry["servers"][name]]
        if not points:
            continue
        size = [p for p, _ in points]
        for ax, streams in zip(axes, ("1 streams", "8 streams")):
            ax.plot(size, [f.get(streams, {}).get("tokens_per_s") or 0 for _, f in points], marker="o", label=name)
        axes[2].plot(size, [f["memory_after_first_request"].get("rss", 0) / 2**30 for _, f in points], marker="o",
                     label=name)
    for ax, label in zip(axes, ("tokens/s, 1 stream", "tokens/s, 8 streams", "resident memory, GiB")):
        ax.set_xlabel("parameters, billions")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    axes[0].set_title(_title(report), fontsize=9)


def draw_all(results: Path, out: Path) -> list[Path]:
    plt = _plt()
    out.mkdir(parents=True, exist_ok=True)
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}
    written = []
    five = {name: r for name, r in runs.items() if r.get("bench") == "compare" and len(r["results"]) >= 2
            and {"ours", "llama.cpp", "transformers"} <= set(next(iter(r["results"].values())))}
    for name, report in five.items():
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        streams_axes(ax, report)
        written.append(_save(fig, out / f"{name}.png"))
    if five:
        fig, axes = plt.subplots(1, len(five), figsize=(5.6 * len(five), 3.6), sharey=False, squeeze=False)
        for ax, report in zip(axes[0], five.values()):
            streams_axes(ax, report)
        fig.suptitle("Tokens/s at 1 and 8 streams, same model and load (Qwen2.5-Coder-0.5B, no GPU)", fontsize=10)
        written.append(_save(fig, out / "headline.png"))
    shortcuts = {name: r for name, r in runs.items() if r.get("bench") == "shortcuts"}
    if shortcuts:
        fig, ax = plt.subplots(figsize=(7.2, 3.6))
        labels = ["prefix cache\nTTFT warm/cold"] + [n.replace(", ", "\n") for n in
                                                     next(iter(shortcuts.values())).get("speculative", {})]
        width = 0.8 / len(shortcuts)
        for i, (name, r) in enumerate(shortcuts.items()):
            values = [r.get("prefix", {}).get("warm_vs_cold") or 0] + [
                s["speedup"] for s in r.get("speculative", {}).values()]
            bars = ax.bar([x + (i - (len(shortcuts) - 1) / 2) * width for x in range(len(values))], values, width,
                          label=_title(r))
            ax.bar_label(bars, fmt="%.2fx", fontsize=7)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylabel("ratio (on ÷ off)")
        ax.set_title("Prefix cache and n-gram speculation: on against off", fontsize=10)
        ax.legend(fontsize=7)
        written.append(_save(fig, out / "shortcuts.png"))
    for name, report in ((n, r) for n, r in runs.items() if r.get("bench") == "scaling" and len(r["sizes"]) > 1
                         and not (r.get("settings") or {}).get("load_only")):  # no line to draw, no speed to draw
        fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
        scaling_axes(axes, report)
        written.append(_save(fig, out / f"{name}.png"))
    with_ttft = {name: r for name, r in runs.items() if r.get("ttft_by_prompt_len")}
    if with_ttft:
        fig, axes = plt.subplots(1, len(with_ttft), figsize=(6.4 * len(with_ttft), 3.8), squeeze=False)
        for ax, report in zip(axes[0], with_ttft.values()):
            ttft_axes(ax, report)
        fig.suptitle("Time to first token against prompt length, same servers and prompts", fontsize=10)
        written.append(_save(fig, out / "ttft-by-prompt-length.png"))
    else:
        print("TTFT against prompt length: no result in docs/results/ records it yet (ttft_by_prompt_len); skipped")
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, **PNG)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
