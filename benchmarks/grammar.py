"""`python -m benchmarks grammar`: what structured output costs.

1) engines: xgrammar and llguidance (when installed) on this model's vocabulary: tokenizer setup, compiling a JSON
   schema, and the per-step mask (fill the bitmask + apply it to the logits) at batch 1 and 8, following a fixed
   document token by token. Both apply with xgrammar's CPU kernel: llguidance's own torch fallback is far slower.
   With `--hostile`: the hostile schemas of docs/limits.md (the shapes our static bounds now refuse), each engine
   compiling in a process of its own under a deadline, and llguidance's first mask (it builds lazily, so part of
   its work moves to the first steps).
2) decode: the same batch decoding greedily with and without a json_schema grammar on every row, as the engine
   runs it (`forward` + `choose_many`): ms per step and the overhead in percent. Rows without a grammar never
   reach the mask code, so their cost is the plain figure.
With `--out` the report is written as JSON that starts with `record.envelope` (machine, versions, settings, date).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch

from benchmarks import record
from app.config import Settings
from app.core.runner.packed import enable_packed_batching
from app.structured.grammars import Grammars
from app.core.runner.forward import forward
from app.core.sequence import Sequence, choose_many
from app.core.sampling import SamplingParams
from app.models.loading import load_model

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"]}}, "required": ["name", "age", "tags"]}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"],
            "address": {"city": "London", "zip": "W1"}}
# What one greedy client sent (docs/limits.md): each is refused today by a bound summed over the schema.
HOSTILE = {
    "20 properties of pattern (a|b){0,1000}": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^(a|b){0,1000}$"} for i in range(20)},
        "required": [f"p{i}" for i in range(20)]},
    "enum of 20,000 strings": {
        "type": "object", "properties": {"e": {"enum": [f"value-{i:05d}-xyz" for i in range(20000)]}}, "required": ["e"]},
    "200 sequential [a-z]{0,1000} in one pattern": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "^" + "[a-z]{0,1000}," * 200 + "$"}},
        "required": ["s"]},
    "the 4-property schema above (innocent)": SCHEMA,
}
PROMPT = "Describe Ada Lovelace as JSON with name, age, tags and address."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: $MODEL or the embedded default")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--steps", type=int, default=24, help="decode steps per timed run")
    parser.add_argument("--batches", default="1,8", help="batch sizes to time")
    parser.add_argument("--hostile", action="store_true", help="also time both engines on the hostile schemas")
    parser.add_argument("--hostile-limit", type=float, default=60, help="seconds one hostile compile may take")
    parser.add_argument("--engines-only", action="store_true", help="skip the decode runs (no model weights)")
    parser.add_argument("--out", default=None, help="also write the figures as JSON here (docs/results/ keeps "
                        "the ones the docs cite)")


def time_engines(tokenizer, vocab_size: int, eos_ids: list[int], batches: list[int]) -> dict:
    ids = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    out: dict = {"document_tokens": len(ids)}
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_ids)
    setup = time.perf_counter() - start
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True, max_whitespace_cnt=4)
    out["xgrammar"] = {"setup_ms": setup * 1e3, "compile_ms": (time.perf_counter() - start) * 1e3}
    for b in batches:
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(b)]
        out["xgrammar"][f"step_ms_b{b}"] = _mask_loop(ids, vocab_size, matchers, lambda m, mask, r: m.fill_next_token_bitmask(mask, r),
                                                     lambda m, t: m.accept_token(t))
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as llt
    except ImportError:
        return out
    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids[0])
    setup = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": True})
    llguidance.LLMatcher(lltok, grammar)
    out["llguidance"] = {"setup_ms": setup * 1e3, "compile_ms": (time.perf_counter() - start) * 1e3}
    for b in batches:
        matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(b)]
        out["llguidance"][f"step_ms_b{b}"] = _mask_loop(ids, vocab_size, matchers, lambda m, mask, r: llt.fill_next_token_bitmask(m, mask, r),
                                                       lambda m, t: m.consume_token(t))
    return out


def _compile_one(engine: str, tokenizer, vocab_size: int, eos_ids: list[int], schema: dict, out) -> None:
    """In a child process: compile `schema` with `engine`, send back ms (and llguidance's first mask)."""
    text = json.dumps(schema)
    if engine == "xgrammar":
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_ids)
        compiler = xgr.GrammarCompiler(info, cache_enabled=False, max_threads=1)
        start = time.perf_counter()
        compiler.compile_json_schema(text, any_whitespace=True, max_whitespace_cnt=4)
        out.put({"compile_ms": (time.perf_counter() - start) * 1e3})
        return
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids[0])
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(
        text, defaults={"whitespace_flexible": True}))
    compiled = (time.perf_counter() - start) * 1e3
    bitmask = llt.allocate_token_bitmask(1, vocab_size)
    start = time.perf_counter()
    llt.fill_next_token_bitmask(matcher, bitmask, 0)
    out.put({"compile_ms": compiled, "first_mask_ms": (time.perf_counter() - start) * 1e3,
             "error": matcher.get_error() or None})


def time_hostile(tokenizer, vocab_size: int, eos_ids: list[int], limit_s: float) -> dict:
    """Each engine on each hostile schema, in a forked process killed past `limit_s` (as our worker is)."""
    import multiprocessing

    engines = ["xgrammar"] + (["llguidance"] if importlib.util.find_spec("llguidance") else [])
    context = multiprocessing.get_context("fork")
    out: dict = {"limit_s": limit_s}
    for name, schema in HOSTILE.items():
        for engine in engines:
            queue = context.Queue()
            child = context.Process(target=_compile_one, args=(engine, tokenizer, vocab_size, eos_ids, schema, queue))
            child.start()
            child.join(limit_s)
            if child.is_alive():
                child.kill()
                child.join()
                result = {"killed_after_s": limit_s}
            else:
                result = queue.get() if not queue.empty() else {"exit_code": child.exitcode}
            out.setdefault(engine, {})[name] = result
            print(f"{engine:11s} {name}: {result}", flush=True)
    return out


def _mask_loop(ids, vocab_size, matchers, fill, accept) -> float:
    """ms per step to fill every row's bitmask and apply it; the accept afterwards is not timed."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    logits = torch.randn(len(matchers), vocab_size)
    spent = 0.0
    for token in ids:
        start = time.perf_counter()
        for row, m in enumerate(matchers):
            fill(m, bitmask, row)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        spent += time.perf_counter() - start
        for m in matchers:
            accept(m, token)
    return spent / len(ids) * 1e3


def time_decode(lm, batch: int, steps: int, grammar) -> float:
    """ms per decode step for `batch` greedy rows, all with `grammar` or all without."""
    prompt = lm.encode_chat([{"role": "user", "content": PROMPT}])
    params = SamplingParams(temperature=0, max_tokens=steps + 2, grammar=grammar)
    seqs = [Sequence(lm.model, lm.tokenizer, prompt, params, lm.eos_ids, lm.max_context) for _ in range(batch)]
    logits = forward(lm.model, [(s, s.prompt_len) for s in seqs])
    choose_many(seqs, logits)
    start = time.perf_counter()
    for _ in range(steps):
        logits = forward(lm.model, [(s, 1) for s in seqs])
        choose_many(seqs, logits)
    return (time.perf_counter() - start) / steps * 1e3


def run(args: argparse.Namespace) -> dict:
    given = {k: getattr(args, k) for k in ("model", "device", "dtype") if getattr(args, k) is not None}
    settings = Settings(**given)
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_grad_enabled(False)
    lm = load_model(settings.model, settings.device, settings.dtype, settings.model_cache)
    report: dict = {**record.envelope("grammar", args), "model": settings.model, "vocab_size": lm.vocab_size,
                    "tokenizer_size": len(lm.tokenizer),
                    "engines": time_engines(lm.tokenizer, lm.vocab_size, list(lm.eos_ids), batches)}
    if args.hostile:
        report["hostile"] = time_hostile(lm.tokenizer, lm.vocab_size, list(lm.eos_ids), args.hostile_limit)
    if not args.engines_only:
        if not enable_packed_batching(lm.model):
            raise SystemExit("this model cannot batch in one pass; the decode comparison needs it")
        grammar = Grammars(lm.tokenizer, lm.vocab_size, lm.eos_ids).json_schema(SCHEMA)
        for b in batches:
            time_decode(lm, b, 4, None)  # warm-up
            plain, constrained = time_decode(lm, b, args.steps, None), time_decode(lm, b, args.steps, grammar)
            report[f"decode_b{b}"] = {"plain_ms": plain, "json_schema_ms": constrained,
                                      "overhead_pct": (constrained / plain - 1) * 100}
    print(json.dumps({k: v for k, v in report.items() if k not in ("machine", "versions")}, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report
