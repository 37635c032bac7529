"""`python -m benchmarks lora`: what serving a LoRA adapter costs against the base model, in one engine.

It makes random peft adapters of the model (rank `--rank` on every linear of the body: the costliest common case),
loads them as LORA_MODULES would, and runs the same greedy requests through one in-process Engine:
- 1 stream: the base, then an adapter;
- 8 streams: all the base, all one adapter, and a mix (base, two adapters) in the same batches.
Tokens/s is all the streams' generated tokens over the wall time from the first submit to the last token (the
prompts' prefill included), EOS ignored so every stream runs `--tokens`; the cases run in interleaved rounds and the
best round of each is reported. Then each case's decode pass alone (`forward` over the same rows, the cases
interleaved pass by pass, the median): what the adapters cost in the model itself. Prints a table; nothing is
written to docs/.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from app.config import DEFAULT_MODEL
from app.core.engine.engine import Engine
from app.core.sampling import SamplingParams
from app.models.fetch import fetch_model
from app.models.loading import load_model
from app.models.lora import LoraAdapters

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name or a local HF directory")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per stream")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each case; the best is reported")
    parser.add_argument("--passes", type=int, default=30, help="timed decode passes per case (median reported)")


def make_adapter(path: str, where: Path, rank: int, seed: int) -> None:
    from peft import LoraConfig, get_peft_model  # a test extra: only this bench and the tests need it
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                  init_lora_weights=False))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    peft_model.save_pretrained(where)


def tokens_per_s(engine: Engine, prompt: list[int], adapters: list[str | None], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, do_sample=False, ignore_eos=True)

    async def one(name):
        handle = engine.submit(prompt, params, adapter=engine.adapters.get(name) if name else None)
        return sum([1 async for _ in handle])

    async def main():
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(name) for name in adapters))
        return sum(counts) / (time.perf_counter() - started)

    return asyncio.run(main())


def pass_ms(lm, registry: LoraAdapters, prompt: list[int], cases: list[tuple[str, list[str | None]]],
            passes: int) -> dict[str, float]:
    """Median ms of one decode pass (every row feeds one token) per case, the cases interleaved pass by pass: the
    adapters' cost in the forward pass alone, without sampling, scheduling or prefill."""
    from app.core.runner.forward import forward
    from app.core.sequence import Sequence

    rows = {}
    for label, names in cases:
        seqs = []
        for name in names:
            seq = Sequence(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=passes + 8), lm.eos_ids,
                           lm.max_context)
            seq.adapter = registry.get(name) if name else None
            forward(lm.model, [(seq, len(prompt))])  # prefilled; each timed pass then decodes one more token
            seqs.append(seq)
        rows[label] = sorted(seqs, key=lambda seq: "" if seq.adapter is None else seq.adapter.key)  # as step.py
    times: dict[str, list[float]] = {label: [] for label, _ in cases}
    for _ in range(passes):
        for label, seqs in rows.items():
            started = time.perf_counter()
            forward(lm.model, [(seq, 1) for seq in seqs])
            times[label].append((time.perf_counter() - started) * 1000)
    return {label: statistics.median(values) for label, values in times.items()}


def run(args: argparse.Namespace) -> list[tuple[str, float]]:
    path = str(fetch_model(args.model, Path.home() / ".cache" / "simple-serve"))
    with tempfile.TemporaryDirectory() as tmp:
        modules = {}
        for seed, name in enumerate(("a1", "a2")):
            make_adapter(path, Path(tmp) / name, args.rank, seed)
            modules[name] = str(Path(tmp) / name)
        lm = load_model(path, device="cpu", dtype=args.dtype)
        engine = Engine(lm, adapters=LoraAdapters(lm.name, modules, max_rank=args.rank), speculative="off")
        engine.start()
        engine.loaded.wait()
        if engine.load_error is not None:
            raise engine.load_error
        try:
            prompt = lm.encode_chat([{"role": "user", "content": PROMPT}])
            cases = [("1 stream, base", [None]), ("1 stream, adapter", ["a1"]),
                     ("8 streams, base", [None] * 8), ("8 streams, one adapter", ["a1"] * 8),
                     ("8 streams, base + two adapters", [None, "a1", "a2"] * 2 + ["a1", "a2"])]
            tokens_per_s(engine, prompt, [None, "a1"], 4)  # warm-up
            best = {label: 0.0 for label, _ in cases}
            for _ in range(args.repeats):  # rounds of every case, interleaved: a busy neighbour hits all alike
                for label, names in cases:
                    best[label] = max(best[label], tokens_per_s(engine, prompt, names, args.tokens))
            results = list(best.items())
        finally:
            engine.stop()
        step = pass_ms(lm, engine.adapters, prompt, cases, args.passes)
    print(f"{args.model}, {lm.dtype}, LoRA rank {args.rank} on {', '.join(TARGETS)}; {args.tokens} tokens a stream, "
          f"best of {args.repeats}; {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    print("| case | tokens/s | ms per decode pass (median) |\n| --- | --- | --- |")
    for label, value in results:
        print(f"| {label} | {value:.1f} | {step[label]:.1f} |")
    return results
