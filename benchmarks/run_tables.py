"""The docs' tables for `bench grammar`, `bench generate`, `bench soak`, `bench routing` and `bench scaling`, from
their JSON.

Each kind reads the keys the bench itself writes, so a fresh run's `--out` file drops into docs/results/ and its
table follows; the older runs there are transcriptions of the README in the same keys, with only what it stated.
Like benchmarks/figures.py, a derived figure (an overhead, a ratio) is printed from the file, never recomputed from
rounded figures.
"""

from __future__ import annotations

import ast
from pathlib import Path

from benchmarks.cells import DTYPES, markdown, ms, provenance

GRAMMAR_GOAL = "<= 10%"  # the bound on what a json_schema grammar may add to a decode step
GENERATE_ROWS = {  # bench generate's contender -> its row, when the run had prepacked weights
    "ours": "our loop, prepacked weights (as served)",
    "ours_plain": "our loop, plain weights",
    "hf_generate": "`model.generate()`, plain weights (as transformers runs it)",
    "hf_generate_prepacked": "`model.generate()`, prepacked weights",
    "ours_int8": "our loop, `QUANT=int8`",
}


def grammar_decode_table(runs: list[tuple[str, dict]]) -> str:
    """One row per run and batch size: plain step, json_schema step, the bench's overhead, the goal."""
    rows = []
    for _, r in runs:
        label = f", {r['label']}" if r.get("label") else ""
        for key in sorted((k for k in r if k.startswith("decode_b")), key=lambda k: int(k.removeprefix("decode_b"))):
            d = r[key]
            overhead = f"{d['overhead_pct']:+.1f}%"
            # a grammar cannot make a step faster: a negative overhead is the machine's noise
            overhead += " (noise)" if d["overhead_pct"] < 0 else ""
            rows.append([f"batch {key.removeprefix('decode_b')}{label}", f"{d['plain_ms']:.1f} ms",
                         f"{d['json_schema_ms']:.1f} ms", overhead, GRAMMAR_GOAL])
    head = ["", "plain step", "json_schema step", "overhead", "goal"]
    return markdown(head, rows) + "\n\n" + provenance(runs)


def generate_table(runs: list[tuple[str, dict]]) -> str:
    """Decode tokens/s of each contender per run, the TTFT of the runs that recorded it, and the memory floor."""
    labels = [r.get("label") or f"run {i + 1}" for i, (_, r) in enumerate(runs)]
    with_ttft = [(label, r) for label, (_, r) in zip(labels, runs) if r.get("ours_ttft_s") is not None]
    head = [""] + [f"{label}: decode tokens/s" for label in labels] + [f"{label}: time to first token"
                                                                     for label, _ in with_ttft]
    rows = []
    for key, name in GENERATE_ROWS.items():
        if not any(f"{key}_tokens_per_s" in r for _, r in runs):
            continue
        rows.append([name] + [f"{r[f'{key}_tokens_per_s']:.1f}" if f"{key}_tokens_per_s" in r else "-"
                              for _, r in runs] + [ms(r.get(f"{key}_ttft_s")) for _, r in with_ttft])
    per_step = " / ".join(dict.fromkeys(f"{r['bytes_per_decode_step'] / 1e9:.3f}" for _, r in runs))
    bandwidth = " / ".join(f"{r['read_GBps']:.1f}" for _, r in runs)
    rows.append([f"memory floor: {per_step} GB read per step ÷ best read bandwidth of the run ({bandwidth} GB/s)"]
                + [f"{r['floor_tokens_per_s']:.1f}" for _, r in runs] + ["" for _ in with_ttft])
    return markdown(head, rows) + "\n\n" + provenance(runs)


def soak_table(runs: list[tuple[str, dict]]) -> str:
    """What a soak run checked and found, one row per check, in words (the run's own report, benchmarks/soak.py)."""
    rows = []
    for _, r in runs:
        rows += soak_rows(r)
    return markdown(["check", "result"], rows) + "\n\n" + provenance(runs)


def soak_rows(r: dict) -> list[list[str]]:
    n = lambda v: f"{v:,}"  # noqa: E731
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    sent, statuses, rss = r["requests"], dict(r["statuses"]), r["rss"]
    kinds = [("stream", "streams"), ("non_stream", "non-streamed"), ("cancel", "cancelled mid-stream"),
             ("timeout", "client timeouts"), ("bad", "invalid")]
    load = "; ".join([f"{r['load_s'] / 60:.1f} minutes",
                      ", ".join([f"{n(sent[k])} {words}" for k, words in kinds if k in sent]
                                + [f"{n(r['bursts'])} bursts of {r['config']['burst']}"]),
                      f"{n(r['completion_tokens'])} completion tokens"])
    client_5xx = sum(v for k, v in statuses.items() if k.startswith("5"))
    five = (f"{'none' if not client_5xx else n(client_5xx)} seen by the clients, "
            f"{'none' if not r['server_5xx'] else n(r['server_5xx'])} counted by the server "
            "(`simple_serve_requests_total`)")
    silent = statuses.pop("none", 0)
    ok = [f"{n(v)} × {k}" for k, v in statuses.items() if k.startswith("2")]
    invalid = [f"{n(v)} × {k}" for k, v in statuses.items() if k.startswith("4") and k != "429"]
    status_text = ", ".join(ok + [" and ".join([", ".join(invalid[:-1]), invalid[-1]] if len(invalid) > 1
                                                else invalid) + " (the invalid requests, all with OpenAI error JSON)"])
    if "429" in statuses:
        status_text += f", {n(statuses['429'])} × 429 (the bursts past the queue cap, all with OpenAI error JSON)"
    if silent:
        status_text += f"; {n(silent)} client timeouts saw nothing, as intended"
    streams = (f"{n(r['streams_ok'])} ended with `[DONE]`; {n(r['streams_clean_error'])} ended with a clean error "
               f"(a 429 before the stream began, or an SSE error event); {n(r['cancelled_mid_stream'])} cancelled "
               "mid-stream")
    limit = r.get("rss_growth_limit", 0.05)
    growth = (f"**{rss['growth']:+.2%}** from {rss['from_s']:.0f} s to the end: "
              f"{'OK' if rss['growth'] < limit else 'FAILED'} (< {limit:.0%})")
    raw = (f"{mib(rss['start_bytes'])} at {rss['from_s']:.0f} s → {mib(rss['end_bytes'])} at the end, "
           f"{rss['raw_growth']:+.1%} (peak {mib(rss['peak_bytes'])})")
    if rss.get("prefix_cache_end_bytes") is not None:
        bound = r.get("server", {}).get("prefix_cache_bytes")
        raw += (f": the prefix cache filled from {rss['prefix_cache_start_bytes'] / 2**20:,.1f} to "
                f"{mib(rss['prefix_cache_end_bytes'])}")
        raw += f", against its {bound // 2**20} MiB bound" if bound else ""
    gauges = r["idle_gauges_after"]
    names = {"simple_serve_active_sequences": "active sequences", "simple_serve_queue_depth": "queue"}
    settled = r.get("settled_s")
    after = ", ".join(f"{names.get(k, f'`{k}`')} {v:g}" for k, v in gauges.items()) + ", " + (
        "never settled" if settled is None else "at once" if settled < 1 else f"after {settled:.1f} s")
    return [["load", load], ["5xx", five], ["statuses", status_text], ["streams", streams],
            ["RSS less the prefix cache", growth], ["RSS, raw", raw], ["after the load", after]]


def routing_table(runs: list[tuple[str, dict]]) -> str:
    """Per policy: pooled prefix-cache hit rate, TTFT p50 / p99, requests per replica, and each round's hit rate and
    TTFT p50 (how far one round's median moves from the next is what says how noisy the machine was)."""
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


def step_table(runs: list[tuple[str, dict]]) -> str:
    """`bench step`: per model, dtype and batch, ms per decode step eager and compiled, tokens/s against the memory
    floor, the compile time, and how many greedy tokens the two paths agreed on."""
    rows = []
    for _, r in runs:
        for row in r["results"]:
            rows.append([Path(row["model"]).name, DTYPES.get(row["dtype"], row["dtype"]), str(row["batch"]),
                         f"{row['eager_ms']:.1f}", f"{row['compiled_ms']:.1f}",
                         f"{row['eager_ms'] / row['compiled_ms']:.2f}x",
                         f"{row['compiled_tokens_per_s'] / row['floor_tokens_per_s']:.0%}",
                         f"{row['compile_s']:.0f} s", row["same_greedy_tokens"]])
    head = ["model", "dtype", "batch", "eager ms/step", "compiled ms/step", "compiled speed-up",
            "compiled, share of the memory floor", "compile time", "same greedy tokens"]
    return markdown(head, rows) + "\n\n" + provenance(runs)


SCALING_NAMES = {"ours": "ours, defaults", "ours-int8": "ours, `QUANT=int8`", "ours-int4": "ours, `QUANT=int4`",
                 "ours-int4-copy": "ours, `QUANT=int4` + `INT4_WIDE_COPY`", "llama.cpp-Q4_K_M": "llama.cpp, Q4_K_M",
                 "llama.cpp-Q8_0": "llama.cpp, Q8_0"}


def _mib(nbytes: int | None) -> str:
    return "-" if not nbytes else f"{nbytes / 2**20:,.0f} MiB"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ttft(entry: tuple[str, dict] | None) -> str:
    return "-" if entry is None else f"{ms(entry[1]['ttft_p50_s'])} ({entry[0].removeprefix('idle TTFT at ')})"


def scaling_table(runs: list[tuple[str, dict]]) -> str:
    """`bench scaling`: per size and server, its resident memory beside every speed figure."""
    head = ["size", "server", "RSS after one answer", "tok/s, 1 stream", "tok/s, 8 streams", "idle TTFT, short",
            "idle TTFT, long", "decode tok/s, long context", "peak RSS"]
    rows = []
    for _, r in runs:
        for size, entry in r["sizes"].items():
            for name, figures in entry["servers"].items():
                label = [f"{size} ({entry['parameters'] / 1e9:.2f}B)", SCALING_NAMES.get(name, name)]
                if "crashed" in figures or "skipped" in figures:
                    rows.append(label + [figures.get("crashed") or figures.get("skipped")] + [""] * 6)
                    continue
                rates = {k: v["tokens_per_s"] for k, v in figures.items() if k.endswith(" streams")}
                short, long = ([(k, v) for k, v in figures.items() if k.startswith("idle TTFT at ")] + [None] * 2)[:2]
                decode = next((v["tokens_per_s"] for k, v in figures.items() if k.startswith("decode at")), None)
                rows.append(label + [_mib(figures["memory_after_first_request"].get("rss")),
                                     _rate(rates.get("1 streams")), _rate(rates.get("8 streams")), _ttft(short),
                                     _ttft(long), _rate(decode), _mib(figures.get("memory_at_end", {}).get("peak"))])
    against = against_llamacpp(runs)
    dates = {size: entry["date"] for _, r in runs for size, entry in r["sizes"].items() if entry.get("date")}
    when = ("Each size's run began: " + "; ".join(f"{size} {date}" for size, date in dates.items()) + ".\n\n"
            if len(set(dates.values())) > 1 else "")  # a run resumed (--resume) after a stop
    return (markdown(head, rows) + ("\n\n" + against if against else "") + "\n\n" + when + provenance(runs))


def load_table(runs: list[tuple[str, dict]]) -> str:
    """`bench scaling` (a full run or `--load-only`): per run, size and server, the peak resident memory (VmHWM:
    loading and one short answer, or the whole run), what stays after one answer, the weights the server says it
    holds, and its time to ready. Runs of several commits side by side show what a change did to the load."""
    head = ["run began", "size", "server", "peak RSS (VmHWM at the end)", "RSS after one answer", "weights held",
            "ready in"]
    rows = []
    for _, r in runs:
        for size, entry in r["sizes"].items():
            for name, figures in entry["servers"].items():
                if "memory_after_first_request" not in figures:
                    continue
                held = (figures.get("weight_bytes") or {}).get("total")
                ready = figures.get("ready_s")
                rows.append([entry.get("date") or r.get("date") or "-", size, SCALING_NAMES.get(name, name),
                             _mib(figures.get("memory_at_end", {}).get("peak")),
                             _mib(figures["memory_after_first_request"].get("rss")), _mib(held),
                             "-" if ready is None else f"{ready:,.0f} s"])
    return markdown(head, rows) + "\n\n" + provenance(runs)


PEER = "llama.cpp-Q4_K_M"  # issue 49's yardstick: int4 against llama.cpp's 4-bit file, same weights, same run


def against_llamacpp(runs: list[tuple[str, dict]]) -> str:
    """`bench scaling`: each of ours divided by llama.cpp Q4_K_M of the same size and run (tokens/s: above 1 is
    faster; TTFT and RSS: below 1 is less), worked out from the run's own figures, not the rounded cells."""
    def ratio(a: float | None, b: float | None) -> str:
        return "-" if not a or not b else f"{a / b:.2f}x"

    def first(figures: dict, prefix: str) -> dict:
        return next((v for k, v in figures.items() if k.startswith(prefix)), {})

    head = ["size", "server", "tok/s, 1 stream", "tok/s, 8 streams", "idle TTFT, short", "decode, long context",
            "RSS after one answer", "RSS ÷ ours at the defaults"]  # the last: issue 49's memory goal, same run
    rows = []
    for _, r in runs:
        for size, entry in r["sizes"].items():
            peer = entry["servers"].get(PEER, {})
            if "1 streams" not in peer:
                continue
            defaults = entry["servers"].get("ours", {}).get("memory_after_first_request", {}).get("rss")
            for name, figures in entry["servers"].items():
                if name not in SCALING_NAMES or name.startswith("llama.cpp") or "1 streams" not in figures:
                    continue
                rows.append([f"{size}", SCALING_NAMES[name],
                             *(ratio(figures[k]["tokens_per_s"], peer[k]["tokens_per_s"])
                               for k in ("1 streams", "8 streams") if k in figures and k in peer),
                             ratio(first(figures, "idle TTFT at ").get("ttft_p50_s"),
                                   first(peer, "idle TTFT at ").get("ttft_p50_s")),
                             ratio(first(figures, "decode at ").get("tokens_per_s"),
                                   first(peer, "decode at ").get("tokens_per_s")),
                             ratio(figures["memory_after_first_request"].get("rss"),
                                   peer["memory_after_first_request"].get("rss")),
                             ratio(figures["memory_after_first_request"].get("rss"), defaults)])
    if not rows:
        return ""
    return f"Each ÷ llama.cpp's Q4_K_M, same size and run:\n\n" + markdown(head, rows)


def invariance_table(runs: list[tuple[str, dict]]) -> str:
    """`bench invariance` (server level): per run and setting, how many answers amid others and alone again were
    the first alone answer, token for token and logprob for logprob."""
    head = ["model and run", "setting", "amid others: identical", "tokens only", "alone again: identical",
            "tokens only"]
    rows = []
    for _, r in runs:
        sampled, settings = r["settings"].get("temperature") or 0, r["settings"]
        picking = f"temperature {sampled}, seed {settings.get('seed')}" if sampled else "greedy"
        what = (f"{Path(r['model']).name}, {len(r['prompt_lens'])} prompts of {min(r['prompt_lens'])} to "
                f"{max(r['prompt_lens']):,} tokens, {settings.get('rounds')} rounds, {settings.get('max_tokens')} "
                f"tokens, {picking}")
        env = settings.get("env") or []
        env = ast.literal_eval(env) if isinstance(env, str) else env  # an older record kept the list's repr
        for label, run in r.get("runs", {}).items():
            if "summary" not in run:
                continue
            amid, again = run["summary"]["amid_others"], run["summary"]["alone_again"]
            also = [e for e in env if e.partition("=")[0] != label.partition("=")[0]]  # --env, where --compare left it
            setting = label + (f" (with {', '.join(also)})" if also else "")
            rows.append([what, setting, *(f"{counts[key]} of {counts['n']}" for counts in (amid, again)
                                        for key in ("identical", "tokens_identical"))])
            what = ""
    across = [line for _, r in runs for line in _across_settings(r)]
    return markdown(head, rows) + "".join(f"\n\n{line}" for line in across) + "\n\n" + provenance(runs)


def _across_settings(report: dict) -> list[str]:
    """Where a run compared settings, whether each prompt's first alone answer (a cold prefix cache) under a later
    setting is the first setting's, token for token and logprob for logprob: speculation on against off must not
    change an answer, greedy or seeded. Read from the answers the file keeps."""
    settings = [(label, run) for label, run in report.get("runs", {}).items() if run.get("prompts")]
    lines = []
    for label, run in settings[1:]:
        first_label, first = settings[0]
        pairs = [(a["answers"].get("alone 1"), b["answers"].get("alone 1"))
                 for a, b in zip(first["prompts"], run["prompts"]) if "answers" in a and "answers" in b]
        if pairs:
            same = sum(a is not None and a == b for a, b in pairs)
            tokens = sum(a is not None and b is not None and a["tokens"] == b["tokens"] for a, b in pairs)
            lines.append(f"Each prompt's first alone answer with {label} against {first_label} "
                         f"({Path(report['model']).name}): {same} of {len(pairs)} identical token for token and "
                         f"logprob for logprob, {tokens} of {len(pairs)} token for token.")
    return lines


TABLES = {"invariance": invariance_table, "scaling": scaling_table, "load": load_table, "grammar-decode": grammar_decode_table, "generate": generate_table,
          "soak": soak_table, "routing": routing_table, "step": step_table}
