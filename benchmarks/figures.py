"""The docs' benchmark tables and charts, made from the bench JSON kept under docs/results/.

Each table kind reads one or more result files (what `bench compare`, `bench shortcuts` and `bench quality` write,
or a transcription of an older run in the same keys) and returns markdown; `benchmarks/docs.py` puts it between the
markers of a docs page. A ratio is printed only where the file holds it (the benches compute ratios from unrounded
figures, so a ratio recomputed from a rounded table could differ in its last digit). `charts` draws the PNGs with
matplotlib, imported only there, so the tables (and the test that checks them) need no plotting library.
"""

from __future__ import annotations

from benchmarks import cited_tables, goal_tables, models_table, run_tables
from benchmarks.cells import DTYPES, markdown, ms, provenance, ratio, ttft_cell

SERVER_NAMES = {"ours": "simple-serve", "ours-int8": "simple-serve, `QUANT=int8`", "ours-int4": "simple-serve, `QUANT=int4`",
                "ours-compiled": "simple-serve, `DECODE_STEP=compiled`",
                "ours-invariant": "simple-serve, `BATCH_INVARIANT=on`", "ours-variant": "simple-serve, `BATCH_INVARIANT=off`",
                "llama.cpp": "llama.cpp `llama-server`", "transformers": "`transformers serve`",
                "transformers-cb": "`transformers serve --continuous-batching`"}
VARIANT_NAMES = {
    "fp32 (reference)": "fp32 (the reference)",
    "bf16": "bf16",
    "int8": "`QUANT=int8`, dynamic (fp32 activations, per-row scales)",
    "int8-one-scale-per-call": "`QUANT=int8`, one activation scale per call (before the per-row fix)",
    "int8-weight-only-bf16": "`QUANT=int8` with `DTYPE=bfloat16`: weight-only int8, bf16 activations",
    "int4": "`QUANT=int4`: 4 bits in groups of 32 (bf16 activations), lm_head int8",
}
SHORTCUT_ROWS = {  # bench shortcuts' scenario -> (what the row measures, its goal)
    "code edit, greedy": ("speculation: decode tokens/s, a code edit that copies most of its prompt, greedy",
                          ">= 1.8x"),
    "code edit, model sampling": ("the same edit with the model's own sampling (seeded)", ""),
    "open chat, greedy": ("open-ended chat, greedy", ">= 0.95x"),
    "open chat, model sampling": ("open-ended chat, the model's own sampling (seeded)", ">= 0.95x"),
}


def server_name(kind: str, report: dict) -> str:
    if kind == "ours":
        return f"simple-serve, {DTYPES.get(report.get('dtype'), report.get('dtype'))}"
    return SERVER_NAMES.get(kind, kind)


def compare_table(runs: list[tuple[str, dict]]) -> str:
    """load | server | aggregate tok/s | (ours ÷ this) | TTFT p50 | inter-token p50, every run's rows in turn."""
    has_ratio = any(r.get("ratios", {}).get("ours_vs") for _, r in runs)
    head = ["load", "server", "aggregate tok/s"] + (["ours ÷ this"] if has_ratio else []) + ["TTFT p50",
                                                                                            "inter-token p50"]
    rows = []
    for _, r in runs:
        prefix = f"{r['label']}, " if len(runs) > 1 and r.get("label") else ""
        settings = r.get("settings") or {}
        counts = [settings.get("single_requests"), settings.get("loaded_requests")]
        for n, (scenario, by_server) in enumerate(r["results"].items()):
            load = prefix + scenario + (f", {counts[n]} requests" if n < 2 and counts[n] else "")
            for i, (kind, m) in enumerate(by_server.items()):
                if "crashed" in m:  # a crashed peer gets a row that says so, and no figure
                    rows.append([load if i == 0 else "", server_name(kind, r), "crashed"]
                                + [""] * (len(head) - 3))
                    continue
                cells = [load if i == 0 else "", server_name(kind, r),
                         f"{m['output_tokens_per_s']['aggregate']:.1f}"]
                if has_ratio:
                    cells.append("" if kind == "ours" else ratio(r.get("ratios", {}).get("ours_vs", {})
                                                                 .get(scenario, {}).get(kind)))
                cells += [ms(m["ttft_s"]["p50"]), ms(m["itl_per_token_s"]["p50"], 1)]
                rows.append(cells)
    return markdown(head, rows) + goals(runs) + "\n\n" + provenance(runs)


def goals(runs: list[tuple[str, dict]]) -> str:
    """The goals' ratios, where a run holds them: ours-int8 against llama.cpp, and ours loaded against one stream."""
    lines = []
    for _, r in runs:
        ratios = r.get("ratios", {})
        for scenario, g in ratios.get("int8_vs_llamacpp", {}).items():
            lines.append(f"{scenario}: ours-int8 ÷ llama.cpp {ratio(g['tokens_per_s'])} the tokens/s"
                         + (f", {ratio(g['ttft_p50'])} the TTFT p50" if g.get("ttft_p50") is not None else ""))
        if (loaded := ratios.get("loaded_vs_single", {}).get("tokens_per_s")) is not None:
            lines.append(f"ours, loaded ÷ 1 stream: {ratio(loaded)} the tokens/s")
    return "\n\n" + "; ".join(lines) + "." if lines else ""


def streams_table(runs: list[tuple[str, dict]]) -> str:
    """server | 1 stream tok/s | TTFT | N streams tok/s | TTFT | N ÷ 1: one row per server of every run."""
    rows, loaded_name = [], "N streams"
    for _, r in runs:
        single, loaded = list(r["results"].values())[:2]
        loaded_name = list(r["results"])[1]
        for kind, one in single.items():
            many = loaded[kind]
            label = f" ({r['label']})" if r.get("label") else ""
            rows.append([server_name(kind, r) + label, f"{one['output_tokens_per_s']['aggregate']:.1f}",
                         ms(one["ttft_s"]["p50"]), f"{many['output_tokens_per_s']['aggregate']:.1f}",
                         ms(many["ttft_s"]["p50"]), ratio(r.get("ratios", {}).get("loaded_vs_single_by_server",
                                                                                   {}).get(kind))])
    head = ["server", "1 stream: tok/s", "TTFT p50", f"{loaded_name}: tok/s", "TTFT p50", f"{loaded_name} ÷ 1"]
    return markdown(head, rows) + "\n\n" + provenance(runs)


def shortcuts_table(runs: list[tuple[str, dict]]) -> str:
    rows = []
    for _, r in runs:
        if p := r.get("prefix"):
            tokens = round(p["prompt_tokens_median"])
            rows.append([f"prefix cache: TTFT, ~{tokens:,}-token prompt, then the same document with another question",
                         ms(p["cold_ttft_s"]), ms(p["warm_ttft_s"]), ratio(p["warm_vs_cold"], 3), "<= 0.15x"])
        settings = r.get("settings") or {}
        for name, s in (r.get("speculative") or {}).items():
            what, goal = SHORTCUT_ROWS.get(name, (name, ""))
            tokens = settings.get("edit_tokens" if name.startswith("code edit") else "chat_tokens")
            what += f", {tokens} tokens" if tokens else ""
            rows.append([what, f"{s['off_tokens_per_s']:.1f}", f"{s['ngram_tokens_per_s']:.1f}", ratio(s["speedup"]),
                         goal])
    return markdown(["what", "off / cold", "on / warm", "ratio", "goal"], rows) + "\n\n" + provenance(runs)


def quality_table(runs: list[tuple[str, dict]]) -> str:
    rows = []
    for _, r in runs:
        ref = r["variants"]["fp32 (reference)"]["perplexity"]
        label = f" ({r['label']})" if len(runs) > 1 and r.get("label") else ""
        for name, v in r["variants"].items():
            if name == "fp32 (reference)" and rows:
                continue  # one reference row: every run's fp32 is the same model on the same text
            agreement, prefix = v.get("teacher_forced_agreement"), v.get("identical_prefix_tokens")
            vs_fp32 = v.get("vs_fp32", v["perplexity"] / ref - 1)  # the bench's, from unrounded perplexities
            rows.append([VARIANT_NAMES.get(name, name) + (label if name != "fp32 (reference)" else ""),
                         f"{v['perplexity']:.3f}", "" if name == "fp32 (reference)" else f"{vs_fp32:+.2%}",
                         "" if agreement is None else f"{agreement:.1%}",
                         "" if prefix is None else ", ".join(map(str, prefix))])
    head = ["variant", "perplexity", "vs fp32", "top-1 agreement", "identical greedy tokens (of 64, per prompt)"]
    return markdown(head, rows) + "\n\n" + provenance(runs)


def ttft_by_prompt_len_table(runs: list[tuple[str, dict]]) -> str:
    """server | TTFT p50 at each prompt length (with the prompt tokens the server counted), from `bench compare
    --prompt-lens`; then the goal's ratio, ours ÷ llama.cpp at the largest length, where the run holds it."""
    lengths = sorted({int(k) for _, r in runs for entries in r["ttft_by_prompt_len"].values() for k in entries})
    rows, lines = [], []
    for _, r in runs:
        label = f" ({r['label']})" if len(runs) > 1 and r.get("label") else ""
        for kind, entries in r["ttft_by_prompt_len"].items():
            rows.append([server_name(kind, r) + label] + [ttft_cell(entries.get(str(n))) for n in lengths])
        g = r.get("ratios", {}).get("ttft_vs_llamacpp_at_largest_prompt_len")
        for kind, value in (g or {}).get("ttft_p50", {}).items():
            lines.append(f"~{g['prompt_len']:,}-token prompt: {server_name(kind, r)} ÷ llama.cpp "
                         + (f"{ratio(value)} the TTFT p50" if value is not None else "no comparison (see the table)")
                         + label)
    head = ["server"] + [f"~{n:,} tokens: TTFT p50" for n in lengths]
    note = "\n\nIn brackets: the prompt tokens the server counted, its chat template included."
    return (markdown(head, rows) + note + ("\n\n" + "; ".join(lines) + "." if lines else "") + "\n\n"
            + provenance(runs))


TABLES = {"compare": compare_table, "compare-streams": streams_table, "shortcuts": shortcuts_table,
          "quality": quality_table, "ttft-by-prompt-length": ttft_by_prompt_len_table}


def tables() -> dict:
    """Every table kind: these, the other benches' (run_tables), the cited summaries (cited_tables), the goals
    (goal_tables) and the supported models (models_table)."""
    return {**TABLES, **run_tables.TABLES, **cited_tables.TABLES, **goal_tables.TABLES, **models_table.TABLES}
