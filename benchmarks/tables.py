"""The one path from a bench's JSON under docs/results/ to a docs table: each table kind reads the keys the bench
writes and returns markdown, with the file, CPU, date and command under it (`provenance`), so a figure in the docs
always names the run it came from. `benchmarks/docs.py` puts a table between a page's markers; `benchmarks/charts.py`
draws from the same readers (`by_class`), so a table and its chart cannot disagree.

A ratio is printed only where the file holds it (the benches compute ratios from unrounded figures). A `cited` file
(docs/results/cited-*.json) is a table transcribed by hand with its provenance: its head and rows, each cell plain
text or `{"text": "... {} ...", "figures": [...]}`, a figure either `{"from": "other.json", "key": "a/b"}` (read from
another result file, so a figure a bench's JSON holds is written down once) or `{"value": 1.07}`, each with its
`format` and optional `scale`.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
SERVERS = {"ours": "simple-serve, defaults", "ours-int8": "simple-serve, `QUANT=int8`",
           "ours-int4": "simple-serve, `QUANT=int4`", "ours-int4-copy": "simple-serve, `QUANT=int4` + `INT4_WIDE_COPY`",
           "ours-compiled": "simple-serve, `DECODE_STEP=compiled`", "ours-before": "simple-serve, an earlier commit",
           "ours-invariant": "simple-serve, `BATCH_INVARIANT=on`", "ours-kv8": "simple-serve, `KV_CACHE_DTYPE=int8`",
           "ours-gguf": "simple-serve, the Q4_K_M file (`QUANT=auto`)", "ours-variant": "simple-serve, `BATCH_INVARIANT=off`",
           "llama.cpp": "llama.cpp `llama-server`", "llama.cpp-Q4_K_M": "llama.cpp, Q4_K_M",
           "llama.cpp-Q8_0": "llama.cpp, Q8_0", "transformers": "`transformers serve`",
           "transformers-cb": "`transformers serve --continuous-batching`"}
# A CPU class, as docs/results/ names its files (`scaling-zen4*.json`), and the heading its section has.
CLASSES = {"zen2": "AMD EPYC Zen 2 (AVX2)", "zen3": "AMD EPYC Zen 3 (AVX2 only)",
           "zen4": "AMD EPYC Zen 4 (AVX-512, AVX512_BF16)", "zen5": "AMD EPYC Zen 5 (AVX-512, AVX512_BF16)",
           "amx": "Intel Xeon 6 with AMX"}


def load(results: Path, names: list[str]) -> list[tuple[str, dict]]:
    return [(name, json.loads((results / name).read_text())) for name in names]


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


def mib(nbytes: int | None) -> str:
    return "-" if not nbytes else f"{nbytes / 2**20:,.0f} MiB"


def rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


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


def compare_table(runs: list[tuple[str, dict]]) -> str:
    """`bench compare`: per server, aggregate tokens/s and TTFT p50 alone and at N streams (its first two
    scenarios), and loaded ÷ alone where the run holds it. A crashed server's row says so and holds no figure."""
    rows, loaded_name = [], "N streams"
    for _, r in runs:
        one, many = list(r["results"].values())[:2]
        loaded_name = list(r["results"])[1]
        label = f" ({r['label']})" if len(runs) > 1 and r.get("label") else ""
        for kind in one:
            a, b = one[kind], many.get(kind, {"crashed": "not run"})
            if "crashed" in a or "crashed" in b:
                rows.append([SERVERS.get(kind, kind) + label, "crashed", "", "", "", ""])
                continue
            rows.append([SERVERS.get(kind, kind) + label, rate(a["output_tokens_per_s"]["aggregate"]),
                         ms(a["ttft_s"]["p50"]), rate(b["output_tokens_per_s"]["aggregate"]), ms(b["ttft_s"]["p50"]),
                         _ratio(r.get("ratios", {}).get("loaded_vs_single_by_server", {}).get(kind))])
    head = ["server", "1 stream: tok/s", "TTFT p50", f"{loaded_name}: tok/s", "TTFT p50", f"{loaded_name} ÷ 1"]
    return markdown(head, rows) + "\n\n" + provenance(runs)


def _ratio(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}x"


def quality_table(runs: list[tuple[str, dict]]) -> str:
    """`bench quality`: each variant's perplexity against fp32's, top-1 agreement, identical greedy tokens."""
    rows = []
    for _, r in runs:
        ref = r["variants"]["fp32 (reference)"]["perplexity"]
        for name, v in r["variants"].items():
            if name == "fp32 (reference)" and rows:
                continue  # one reference row: every run's fp32 is the same model on the same text
            agreement, prefix = v.get("teacher_forced_agreement"), v.get("identical_prefix_tokens")
            vs_fp32 = v.get("vs_fp32", v["perplexity"] / ref - 1)  # the bench's, from unrounded perplexities
            rows.append([name, f"{v['perplexity']:.3f}", "" if name == "fp32 (reference)" else f"{vs_fp32:+.2%}",
                         "" if agreement is None else f"{agreement:.1%}",
                         "" if prefix is None else ", ".join(map(str, prefix))])
    head = ["variant", "perplexity", "vs fp32", "top-1 agreement", "identical greedy tokens (of 64, per prompt)"]
    return markdown(head, rows) + "\n\n" + provenance(runs)


LINEAR_FORMATS = ("fp32", "bf16", "fp16", "int8", "int4")  # weight_bytes' keys for the linears (not the table)


def perplexity_table(runs: list[tuple[str, dict]]) -> str:
    """`bench perplexity`: a GGUF as we serve it against llama-perplexity, on the same tokens, scored alike."""
    heads = {"DynamicInt8Linear": "dynamic int8", "WeightOnlyInt8Linear": "weight-only int8"}
    rows = [[Path(r["model"]).name, f"`QUANT={r['ours']['quant']}`" + (f", lm_head {heads[r['ours']['lm_head']]}"
                                                                      if r["ours"].get("lm_head") in heads else "")
             + (", 5- to 8-bit blocks in their own codes" if r["ours"].get("linears", {}).get("GroupInt8Linear")
                else ""),
             f"{r['scored_tokens']:,}",
             f"{r['llama_cpp']['perplexity']:.4f} ± {r['llama_cpp']['plus_minus']:.4f}",
             f"{r['llama_cpp']['perplexity_kv_q8_0']:.4f} "
             f"({r['llama_cpp']['perplexity_kv_q8_0'] / r['llama_cpp']['perplexity'] - 1:+.2%})",
             f"{r['ours']['perplexity']:.4f} ({r['ours']['vs_llama_cpp']:+.2%})",
             f"{r['ours']['perplexity_kv_int8']:.4f} ({r['ours']['kv_int8_vs_cache']:+.2%}), keys in groups of "
             f"{r['ours']['kv_int8_key_group']}",
             f"{sum(r['ours']['weight_bytes'].get(k, 0) for k in LINEAR_FORMATS) / 2**20:,.0f} MiB"] for _, r in runs]
    head = ["GGUF file", "ours loaded as", "tokens scored", "`llama-perplexity`", "its q8_0 cache (vs its f16)",
            "ours (vs llama.cpp)",
            "ours, `KV_CACHE_DTYPE=int8` (vs its own cache)", "ours' linears held"]
    return markdown(head, rows) + "\n\n" + provenance(runs)


def long_context_ratio(figures: dict) -> float | None:
    """A `bench scaling` server's decode tokens/s at --long-context ÷ at the short prompt, both one stream (the
    reciprocals of their inter-token p50s): 1.0 where a long context costs nothing more per token."""
    long = next((v["tokens_per_s"] for k, v in figures.items() if k.startswith("decode at")), None)
    short = figures.get("1 streams", {}).get("itl_p50_s")
    return long * short if long and short else None


def long_context_table(runs: list[tuple[str, dict]]) -> str:
    """`bench scaling`: each server's one-stream decode at the short prompt and at --long-context (reciprocals of
    their inter-token p50s), the ratio, and the memory beside them."""
    rows = []
    for _, r in runs:
        for size, entry in r["sizes"].items():
            for name, f in entry["servers"].items():
                if (ratio := long_context_ratio(f)) is None:
                    continue
                itl = f["1 streams"]["itl_p50_s"]
                memory = f.get("memory_at_end") or f["memory_after_first_request"]
                rows.append([size, SERVERS.get(name, name), rate(1 / itl), rate(ratio / itl), f"{ratio:.2f}x",
                             mib(memory.get("rss")), mib(memory.get("peak"))])
    head = ["model size", "setting", "decode tok/s, short prompt", "decode tok/s, long context", "long ÷ short",
            "resident at the end", "peak"]
    return markdown(head, rows) + "\n\n" + provenance(runs)


def shortcuts_table(runs: list[tuple[str, dict]]) -> str:
    """`bench shortcuts`: the prefix cache's cold and warm TTFT, and n-gram speculation's decode tokens/s off and on."""
    rows = []
    for _, r in runs:
        if p := r.get("prefix"):
            rows.append([f"prefix cache: TTFT, ~{round(p['prompt_tokens_median']):,}-token prompt asked again",
                         ms(p["cold_ttft_s"]), ms(p["warm_ttft_s"]), _ratio(p["warm_vs_cold"], 3)])
        for name, s in (r.get("speculative") or {}).items():
            rows.append([f"speculation: decode tok/s, {name}", rate(s["off_tokens_per_s"]),
                         rate(s["ngram_tokens_per_s"]), _ratio(s["speedup"])])
    return markdown(["what", "off / cold", "on / warm", "on ÷ off"], rows) + "\n\n" + provenance(runs)


def floor_table(runs: list[tuple[str, dict]]) -> str:
    """The bandwidth floor: tokens/s if a decode step cost only reading the weights once at the run's measured read
    bandwidth, against what `bench generate` (our loop) and `bench step` (eager and compiled) reached."""
    rows = []
    for _, r in runs:
        cpu = (r.get("machine") or {}).get("cpu", "?")
        if r["bench"] == "generate":
            split = "; ".join(f"{k} {v:.1f}" for k, v in r.get("profile_ms_per_step", {}).items())
            rows.append([cpu, f"our loop, {r.get('label', '')}, batch 1" + (f" (a step, ms: {split})" if split else ""),
                         rate(r["ours_tokens_per_s"]),
                         rate(r["floor_tokens_per_s"]), f"{r['ours_tokens_per_s'] / r['floor_tokens_per_s']:.0%}"])
        for row in r.get("results", []) if r["bench"] == "step" else []:
            for path in ("eager", "compiled"):
                got = row[f"{path}_tokens_per_s"]
                rows.append([cpu, f"{path} step, {DTYPES.get(row['dtype'], row['dtype'])}, batch {row['batch']}",
                             rate(got), rate(row["floor_tokens_per_s"]), f"{got / row['floor_tokens_per_s']:.0%}"])
    head = ["CPU", "what (0.5B model)", "tokens/s", "floor tokens/s", "share of the floor"]
    return markdown(head, rows) + "\n\n" + provenance(runs)


def grammar_decode_table(runs: list[tuple[str, dict]]) -> str:
    """`bench grammar`: per run and batch size, the plain step, the json_schema step, the overhead, the goal."""
    rows = []
    for _, r in runs:
        label = f", {r['label']}" if r.get("label") else ""
        for key in sorted((k for k in r if k.startswith("decode_b")), key=lambda k: int(k.removeprefix("decode_b"))):
            d = r[key]
            # a grammar cannot make a step faster: a negative overhead is the machine's noise
            overhead = f"{d['overhead_pct']:+.1f}%" + (" (noise)" if d["overhead_pct"] < 0 else "")
            rows.append([f"batch {key.removeprefix('decode_b')}{label}", f"{d['plain_ms']:.1f} ms",
                         f"{d['json_schema_ms']:.1f} ms", overhead, "<= 10%"])
    return markdown(["", "plain step", "json_schema step", "overhead", "goal"], rows) + "\n\n" + provenance(runs)


def routing_table(runs: list[tuple[str, dict]]) -> str:
    """A routing run (docs/scaling.md): per policy, pooled prefix-cache hit rate, TTFT p50 / p99, requests per
    replica, and each round's hit rate and TTFT p50 (how far rounds differ says how noisy the machine was)."""
    rows = []
    for _, r in runs:
        for name, p in r["policies"].items():
            rounds = p.get("rounds", [])
            rows.append([name, f"{p['prefix_hit_rate']:.1%}", ms(p["ttft_s"]["p50"]), ms(p["ttft_s"]["p99"]),
                         " / ".join(map(str, p["per_replica"])),
                         ", ".join(f"{one['prefix_hit_rate']:.0%}" for one in rounds),
                         ", ".join(ms(one.get("ttft_p50_s")) for one in rounds)])
    head = ["policy", "prefix-cache hits", "TTFT p50", "TTFT p99", "requests per replica", "hit rate per round",
            "TTFT p50 per round"]
    lines = markdown(head, rows).splitlines()
    lines[1] = "| --- | ---: | ---: | ---: | ---: | --- | --- |"  # figures right-aligned
    return "\n".join(lines) + "\n\n" + provenance(runs)
