"""`python -m benchmarks invariance --ops`: which module is the first to give a request's rows other numbers when
the request shares its pass with others.

No server: the model is loaded in this process with the run's settings (load_model, as `python -m app serve` loads
it: DTYPE, QUANT, PREPACK, BATCH_INVARIANT ...; the engine's settings such as SPECULATIVE do not apply here). For
each prompt in turn (the target) two runs go step by step side by side, through the engine's one dispatcher
(`run_pass`): alone, the target's whole prompt in one pass, then one token a pass, greedy; packed, the same with
every other prompt in the same passes (their whole prompts in the first, then one token each). The packed target is
fed the tokens the alone run chose, so both runs feed it the same tokens at every step whatever their logits say.

A forward hook on every module (named_modules: any model family) records the target's rows of its output at each
step: along the first of axes 1, 0, 2 whose length is the pass's token count (the packed pass runs all requests as
one row of tokens, the target's first), or along the axis of the pass's requests (lm_head runs only the last
position of each). The first module, in the order the hooks fire (inner modules before the ones that hold them),
whose rows are not bit-identical is the op to fix. Recording digests rather than tensors keeps a 2,000-token
prefill's activations out of memory; a second run up to that step keeps that one module's rows, for the largest
difference.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from pathlib import Path

import torch

StepKey = tuple[str, int]  # (module name, how many times it ran before in this pass)


class Recorder:
    """Forward hooks on every module that record the target's rows of each output during a pass."""

    def __init__(self, model: torch.nn.Module, keep: StepKey | None = None):
        self.trace: dict[StepKey, tuple[bytes, tuple]] = {}  # this pass's digests and shapes, in firing order
        self.kept: torch.Tensor | None = None
        self.keep, self.tokens, self.target, self.requests = keep, 0, 0, 1
        self.handles = [module.register_forward_hook(self._hook(name)) for name, module in model.named_modules()
                        if name]

    def start_pass(self, tokens: int, target: int, requests: int) -> None:
        """tokens: all the pass feeds; target: the target's (first) share; requests: rows of logits the pass ends in."""
        self.trace, self.tokens, self.target, self.requests = {}, tokens, target, requests

    def _hook(self, name: str):
        def hook(module, inputs, output) -> None:
            rows = target_rows(output, self.tokens, self.target, self.requests)
            if rows is None:
                return
            calls = sum(1 for n, _ in self.trace if n == name)
            key = (name, calls)
            rows = rows.detach().contiguous().cpu()
            self.trace[key] = (hashlib.blake2b(rows.reshape(-1).view(torch.uint8).numpy().tobytes(),
                                               digest_size=16).digest(), tuple(rows.shape))
            if key == self.keep:
                self.kept = rows.clone()
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def target_rows(output, tokens: int, target: int, requests: int) -> torch.Tensor | None:
    """The target's rows of a module's output (its first tensor): see the module's docstring. None: none found."""
    tensor = output if isinstance(output, torch.Tensor) else next(
        (t for t in (output if isinstance(output, (tuple, list)) else ()) if isinstance(t, torch.Tensor)), None)
    if tensor is None or not tensor.is_floating_point() or tensor.dim() == 0:
        return None
    for axis in (1, 0, 2):
        if tensor.dim() > axis and tensor.shape[axis] == tokens:
            return tensor.narrow(axis, 0, target)
    for axis in (1, 0):
        if tensor.dim() > axis and tensor.shape[axis] == requests:
            return tensor.narrow(axis, 0, 1)
    return None


class Row:
    """What `forward` reads of a sequence: its token ids (prompt and every token fed so far), its prompt's length
    (under BATCH_INVARIANT a prefill pass computes attention otherwise than a decode pass) and its own cache."""

    def __init__(self, model, prompt: list[int], room: int):
        from transformers import DynamicCache

        self.token_ids = torch.zeros(1, len(prompt) + room, dtype=torch.long, device=model.device)
        self.token_ids[0, : len(prompt)] = torch.tensor(prompt)
        self.prompt_len = self.length = len(prompt)
        self.cache = DynamicCache(config=model.config)

    def feed(self) -> int:
        return self.length - self.cache.get_seq_length()

    def append(self, token: int) -> None:
        self.token_ids[0, self.length] = token
        self.length += 1


def compare_runs(lm, prompts: list[list[int]], target: int, steps: int, keep: tuple[int, StepKey] | None = None
                 ) -> dict:
    """Step the alone and the packed run side by side until a step where the target's rows differ (or `steps`).
    `keep`: (step, key) whose rows to return from both runs (the second run); else the first difference found."""
    model, run_pass = lm.model, engine_pass(lm)
    recorder = Recorder(model, keep[1] if keep else None)
    alone = Row(model, prompts[target], steps)
    packed = [Row(model, p, steps) for p in [prompts[target]] + prompts[:target] + prompts[target + 1:]]
    try:
        for step in range(steps):
            recorder.keep = keep[1] if keep and keep[0] == step else None
            recorder.start_pass(alone.feed(), alone.feed(), 1)
            alone_logits = run_pass([(alone, alone.feed())])[0]
            alone_trace, alone_kept = recorder.trace, recorder.kept
            work = [(row, row.feed()) for row in packed]
            recorder.start_pass(sum(n for _, n in work), work[0][1], len(work))
            packed_logits = run_pass(work)
            if keep and keep[0] == step:
                return {"alone": alone_kept, "packed": recorder.kept}
            token = int(alone_logits.argmax())
            first = first_difference(alone_trace, recorder.trace)
            logits_diff = float((alone_logits - packed_logits[0]).abs().max())
            if first is not None or logits_diff:
                return {"step": step, "first": first, "logits_max_diff": logits_diff,
                        "modules_differing": sum(k in recorder.trace and recorder.trace[k] != v
                                                 for k, v in alone_trace.items()),
                        "modules_compared": sum(k in recorder.trace for k in alone_trace)}
            alone.append(token)
            packed[0].append(token)
            for row, logits in zip(packed[1:], packed_logits[1:]):
                row.append(int(logits.argmax()))
        return {"step": None, "first": None, "logits_max_diff": 0.0,
                "modules_compared": sum(k in recorder.trace for k in alone_trace)}
    finally:
        recorder.remove()


def engine_pass(lm):
    """The engine's pass as its StepRunner calls it: `run_pass` with the model's BATCH_INVARIANT (the engine's
    invariant mode packs one row too, and cuts attention by absolute positions)."""
    from app.core.runner.forward import run_pass

    return lambda work: run_pass(lm.model, work, None, None, lm.batch_invariant)[0]


def first_difference(alone: dict, packed: dict) -> StepKey | None:
    return next((key for key, value in alone.items() if key in packed and packed[key] != value), None)


def load(path: Path, env: dict[str, str]):
    from app.config import Settings
    from app.core.runner.packed import enable_packed_batching
    from app.models.loading import load_model

    settings = Settings(model=str(path), **{k.lower(): v for k, v in env.items()})
    lm = load_model(str(path), settings.device, settings.dtype, settings.model_cache, prepack=settings.prepack,
                    quant=settings.quant, int4_wide_copy=settings.int4_wide_copy,
                    batch_invariant=settings.batch_invariant)
    if not enable_packed_batching(lm.model):  # as the engine does: without it no two requests share a pass
        raise SystemExit(f"error: {path}: this model's attention cannot be packed, so requests never share a pass")
    return lm


def measure(path: Path, env: dict[str, str], prompts: list[str], args: argparse.Namespace) -> dict:
    return measure_model(load(path, env), prompts, args.max_tokens)


def measure_model(lm, prompts: list[str], steps: int) -> dict:
    """Each prompt as the target, amid the others: where its rows first differ (see the module's docstring)."""
    ids = [lm.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    found = []
    for target in range(len(ids)):
        result = compare_runs(lm, ids, target, steps)
        if result["first"] is not None:
            rows = compare_runs(lm, ids, target, steps, keep=(result["step"], result["first"]))
            name, call = result["first"]
            result |= {"module": name, "call": call, "layer": layer_of(name), "shape": list(rows["alone"].shape),
                       "max_diff": float((rows["alone"].double() - rows["packed"].double()).abs().max())}
        result.pop("first")
        found.append({"prompt_tokens": len(ids[target]), **result})
    return {"dtype": str(lm.dtype).removeprefix("torch."), "batch_invariant": getattr(lm, "batch_invariant", None),
            "ops": found}


def layer_of(name: str) -> int | None:
    match = re.search(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)", name)
    return int(match[1]) if match else None


def print_report(report: dict) -> None:
    s = report["settings"]
    print(f"\nbench invariance --ops: {report['model']}, {len(report['prompt_lens'])} prompts, each alone and "
          f"packed with the others, up to {s['max_tokens']} steps ({report['machine']['cpu']})")
    for label, run_ in report["runs"].items():
        print(f"\n{label} ({run_['dtype']}, batch invariant: {run_['batch_invariant']})")
        print(f"{'prompt':>6}{'tokens':>8}{'step':>7}  first module that differs (layer, call)  max difference  "
              f"logits")
        for i, r in enumerate(run_["ops"]):
            step = "-" if r["step"] is None else ("prefill" if r["step"] == 0 else f"decode {r['step']}")
            where = (f"{r['module']} ({'-' if r['layer'] is None else r['layer']}, {r['call']})" if "module" in r
                     else "none" if r["step"] is None else "no module (only the logits)")
            diff = f"{r['max_diff']:.3g}" if "max_diff" in r else "-"
            print(f"{i + 1:>6}{r['prompt_tokens']:>8}{step:>9}  {where:<40}{diff:>15}  {r['logits_max_diff']:.3g}")
        same = sum(r["step"] is None for r in run_["ops"])
        print(f"{same} of {len(run_['ops'])} prompts: every module's rows bit-identical alone and packed, "
              f"{s['max_tokens']} steps")
