"""The `goals` table kind: the side-by-side performance goals, one row per CPU class, each from one `bench compare` run.

Every cell is worked out from the run's own per-server figures (aggregate tokens/s, TTFT p50, inter-token p50),
not typed, so the README's summary cannot drift from the JSON it names. A run that lacks a server (an older run
with no ours-compiled, a crashed llama.cpp) shows "not run" or "crashed" there, never a ratio.
"""

from __future__ import annotations

from benchmarks.cells import DTYPES, markdown, provenance

# (column heading, the goal as stated)
GOALS = [
    ("ours ÷ `transformers serve`, 1 stream", "≥ 1.2x"),
    ("ours ÷ `transformers serve --continuous-batching`, 8 streams", "≥ 1.2x"),
    ("ours, 8 streams ÷ 1 stream", "≥ 3x"),
    ("ours, TTFT p50 at 8 streams ÷ idle", "≤ 2x"),
    ("ours ÷ llama.cpp, TTFT of the longest prompt", "≤ 1x"),
    ("`QUANT=int8` ÷ llama.cpp, inter-token p50, 1 stream", "≤ 1x"),
    ("`QUANT=int8` ÷ llama.cpp, tokens/s, 8 streams", "≥ 1.5x"),
    ("`DECODE_STEP=compiled` ÷ ours, tokens/s, 1 / 8 streams", "> 1x"),
]


def _figure(run: dict, scenario: int, kind: str, key: str) -> float | str:
    """One server's figure in the run's first (1 stream) or second (N streams) scenario, or why there is none."""
    scenarios = list(run["results"].values())
    entry = scenarios[scenario].get(kind) if scenario < len(scenarios) else None
    if entry is None:
        return "not run"
    if "crashed" in entry:
        return f"{kind} crashed"
    value = entry[key]["aggregate" if key == "output_tokens_per_s" else "p50"]
    return value if value else f"{kind}: no figure"


def _ratio(a: float | str, b: float | str) -> str:
    if isinstance(a, str) or isinstance(b, str):
        return next(x for x in (a, b) if isinstance(x, str))
    return f"{a / b:.2f}x"


def _longest_prompt_ttft(run: dict, kind: str) -> float | str:
    by_server = run.get("ttft_by_prompt_len")
    if not by_server or kind not in by_server:
        return "not run"
    entries = by_server[kind]
    entry = entries[max(entries, key=int)]
    return f"{kind} crashed" if "crashed" in entry else (entry["ttft_s"]["p50"] or f"{kind}: no figure")


def row(run: dict) -> list[str]:
    rate, ttft, itl = "output_tokens_per_s", "ttft_s", "itl_per_token_s"
    longest = max(map(int, next(iter(run["ttft_by_prompt_len"].values())))) if run.get("ttft_by_prompt_len") else None
    compiled = [_ratio(_figure(run, s, "ours-compiled", rate), _figure(run, s, "ours", rate)) for s in (0, 1)]
    return [
        f"{(run.get('machine') or {}).get('cpu', '?')}, {DTYPES.get(run.get('dtype'), run.get('dtype'))}, "
        f"{str(run.get('date', '?'))[:10]}",
        _ratio(_figure(run, 0, "ours", rate), _figure(run, 0, "transformers", rate)),
        _ratio(_figure(run, 1, "ours", rate), _figure(run, 1, "transformers-cb", rate)),
        _ratio(_figure(run, 1, "ours", rate), _figure(run, 0, "ours", rate)),
        _ratio(_figure(run, 1, "ours", ttft), _figure(run, 0, "ours", ttft)),
        _ratio(_longest_prompt_ttft(run, "ours"), _longest_prompt_ttft(run, "llama.cpp"))
        + (f" (~{longest:,} tokens)" if longest else ""),
        _ratio(_figure(run, 0, "ours-int8", itl), _figure(run, 0, "llama.cpp", itl)),
        _ratio(_figure(run, 1, "ours-int8", rate), _figure(run, 1, "llama.cpp", rate)),
        compiled[0] if compiled[0] == compiled[1] else " / ".join(compiled),
    ]


def goals_table(runs: list[tuple[str, dict]]) -> str:
    """One row per run (its CPU, default dtype and date); a second header row gives each goal."""
    head = ["CPU, dtype, date"] + [name for name, _ in GOALS]
    rows = [["goal"] + [goal for _, goal in GOALS]] + [row(r) for _, r in runs]
    return markdown(head, rows) + "\n\n" + provenance(runs)


TABLES = {"goals": goals_table}
