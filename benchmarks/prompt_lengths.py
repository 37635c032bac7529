"""`bench compare --prompt-lens 128,512,1200`: TTFT against prompt length, on the servers the run already started.

The goal is a ~1,200-token prompt's TTFT at or under llama.cpp's, and the docs chart TTFT against prompt
length. After the usual scenarios, while every server is still up (no extra start), each length is sent
as one stream, `--prompt-len-requests` requests of `MAX_TOKENS` tokens, round-robin over the servers like the
scenarios, so a slow spell of a shared machine does not land on one server only. Every server gets the same texts.

The prompts are the bench's passages (benchmarks/serve.py), counted with the model's own tokenizer when its
directory has one (else serve.py's estimate), each opened by a tag unique to its length and request. The tag comes
first because both prompt caches match from the start and stop at the first token that differs: ours reuses whole
16-token blocks of an earlier prompt, llama.cpp a slot's longest common prefix. So neither can serve a prompt from
another one; only the chat template's header and the tag's first few tokens ("Prompt 1200-"), the same for every
server, can be reused. Passages alone would not do: the scenarios draw theirs with seeds 0, 1, ... from the same
14 passages, so their prompts open alike and some repeat whole (the warm-up's are the 1-stream scenario's first).

Recorded per server and length (the length as a string: JSON's keys are strings): the TTFT stats, the prompt
tokens the server reported (usage.prompt_tokens, its chat template included; None when it sends no usage), and the
requests and errors. A server that dies, before this phase or during it, gets {"crashed": why} for that length
and every later one, and no ratio: requests that fail fast would otherwise read as a win.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from benchmarks import serve as bench_serve
from benchmarks.cells import ms, ttft_cell
from benchmarks.llamacpp import describe_exit

MAX_TOKENS = 8  # TTFT needs one token; a few more show the stream goes on after it
PEER = "llama.cpp"


def parse(text: str) -> list[int]:
    """`--prompt-lens`: comma-separated token counts, ascending, without repeats; [] when empty (the default)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"error: --prompt-lens: expected comma-separated token counts such as 128,512,1200, "
                         f"got {text!r}")
    return sorted({int(p) for p in parts})


def token_counter(model_dir: Path):
    """The model's tokenizer as a counter, and what counted: the requested lengths are the user message's tokens."""
    if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer  # lazy: only this phase needs it

        tok = AutoTokenizer.from_pretrained(model_dir)
        return (lambda text: len(tok.encode(text, add_special_tokens=False))), "the model's tokenizer"
    return bench_serve.estimate_tokens, "an estimate (~4 characters a token in English, ~1.5 in Chinese)"


def build(lengths: list[int], requests: int, count) -> dict[int, list[str]]:
    """`requests` prompts of ~length tokens for each length, the tag first (see the module's docstring)."""
    prompts = {}
    for length in lengths:
        prompts[length] = []
        for n in range(1, requests + 1):
            tag = f"Prompt {length}-{n}: "
            body = bench_serve.build_prompt(length, seed=1_000_000 + length * 1_000 + n,
                                            count_tokens=lambda text, tag=tag: count(tag + text))
            prompts[length].append(tag + body)
    return prompts


def measure_all(procs: dict[str, tuple[subprocess.Popen, str]], crashed: dict[str, str], model_id: str,
                args: argparse.Namespace, prompts: dict[int, list[str]]) -> dict[str, dict[str, dict]]:
    """{server: {length: figures or {"crashed": why}}}, each length sent to every server in turn."""
    by_server: dict[str, dict[str, dict]] = {kind: {} for kind in procs}
    for length, texts in prompts.items():
        for kind, (proc, url) in procs.items():
            print(f"prompt length {length}: {kind} ...", flush=True)
            by_server[kind][str(length)] = _measure(kind, proc, url, model_id, args, length, texts, crashed)
    return by_server


def _measure(kind: str, proc: subprocess.Popen, url: str, model_id: str, args: argparse.Namespace, length: int,
             texts: list[str], crashed: dict[str, str]) -> dict:
    if kind in crashed:
        return {"crashed": crashed[kind]}
    load = argparse.Namespace(url=url, model=model_id, concurrency=1, requests=len(texts), prompt_len=length,
                              max_tokens=MAX_TOKENS, stream=True, ignore_eos=args.ignore_eos, api_key=None,
                              timeout=600.0, seed=0, tokenizer=None, temperature=args.temperature)
    figures = bench_serve.measure(load, texts)
    if proc.poll() is not None:  # a run that ended in a crash is not measured, whatever its requests did before
        crashed[kind] = f"crashed during the prompt-length run ({describe_exit(proc.returncode)})"
        print(f"{kind} {crashed[kind]}: no figures of it are compared", flush=True)
        return {"crashed": crashed[kind]}
    return {"prompt_tokens": figures["prompt_tokens_mean"], "ttft_s": figures["ttft_s"],
            "requests": figures["requests"], "errors": figures["errors"]}


def ttft_p50(entry: dict | None) -> float | None:
    """A length's TTFT p50, or None where the server is absent, crashed there, or got no first token."""
    if not entry or "crashed" in entry:
        return None
    return entry["ttft_s"]["p50"]


def vs_llamacpp(by_server: dict[str, dict[str, dict]]) -> dict:
    """The goal's ratio at the largest length, from the unrounded figures: each ours* server's TTFT p50 ÷
    llama.cpp's, None where either has no figure (crashed, failed, or not run)."""
    largest = max(int(k) for entries in by_server.values() for k in entries)
    peer = ttft_p50(by_server.get(PEER, {}).get(str(largest)))
    ours = {kind: ttft_p50(entries.get(str(largest))) for kind, entries in by_server.items() if kind.startswith("ours")}
    return {"prompt_len": largest, "ttft_p50": {kind: v / peer if v and peer else None for kind, v in ours.items()}}


def _why_none(name: str, entry: dict | None) -> str:
    if not entry:
        return f"{name} not measured"
    if "crashed" in entry:
        return f"{name} crashed"
    return f"{name} got no first token ({entry['errors']['count']} errors)"


def print_table(report: dict) -> None:
    """TTFT p50 per server and length, then each ours* server against llama.cpp at the largest length."""
    by_server = report["ttft_by_prompt_len"]
    lengths = sorted({int(k) for entries in by_server.values() for k in entries})
    requests = (report.get("settings") or {}).get("prompt_len_requests")
    print(f"\nTTFT p50 against prompt length (1 stream{f', {requests} requests each' if requests else ''}; "
          f"in brackets: the prompt tokens the server counted, its chat template included)")
    print(f"{'server':<18}" + "".join(f"{f'{n} tokens':>22}" for n in lengths))
    for kind, entries in by_server.items():
        print(f"{kind:<18}" + "".join(f"{ttft_cell(entries.get(str(n))):>22}" for n in lengths))
    for kind, entries in by_server.items():  # a crash's cause once per server, under the table
        for why in dict.fromkeys(e["crashed"] for e in entries.values() if "crashed" in e):
            print(f"{kind}: {why}")
    largest = lengths[-1]
    ratios = report.get("ratios", {}).get("ttft_vs_llamacpp_at_largest_prompt_len", {}).get("ttft_p50", {})
    peer = by_server.get(PEER, {}).get(str(largest))
    for kind, ratio in ratios.items():
        head = f"~{largest}-token prompt, TTFT p50, {kind} / {PEER}: "
        if ratio is not None:
            print(head + f"{ratio:.2f}x ({ms(ttft_p50(by_server[kind][str(largest)]))} against {ms(ttft_p50(peer))})")
            continue
        ours = by_server[kind].get(str(largest))
        print(head + "no comparison, " + (_why_none(PEER, peer) if ttft_p50(peer) is None else _why_none(kind, ours)))
