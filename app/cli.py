"""`python -m app generate`: the decode loop on the terminal, optionally showing each step's candidates."""

from __future__ import annotations

import argparse
import json
import sys

from app.config import Settings
from app.core.generate import generate
from app.core.sampling import MAX_INSPECT, Inspection, resolve_sampling_params
from app.errors import InvalidRequest
from app.models.loading import load_model, serves_embeddings

SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "max_tokens", "seed", "stop")


def run_generate(args: argparse.Namespace, settings: Settings) -> int:
    show = args.show_logits or 0
    if args.show_logits is not None and not 1 <= show <= MAX_INSPECT:
        raise InvalidRequest(f"--show-logits takes 1 to {MAX_INSPECT} candidates, got {show}", param="--show-logits")
    if serves_embeddings(settings.model):
        raise InvalidRequest(f"{settings.model} is an embedding model: it generates no text; serve it and use "
                             "/v1/embeddings", param="model")
    lm = load_model(settings.model, settings.device, settings.dtype, settings.model_cache, prepack=settings.prepack,
                    quant=settings.quant, int4_wide_copy=settings.int4_wide_copy, int4_kernel=settings.int4_kernel,
                    batch_invariant=settings.batch_invariant, decode_attention=settings.decode_attention)
    request = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}
    request["inspect"] = show
    params = resolve_sampling_params(request, lm.generation_defaults)
    if args.raw:
        prompt_ids = lm.encode_text(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt_ids = lm.encode_chat(messages + [{"role": "user", "content": args.prompt}])
    print(f"# {lm.name} on {lm.device}, prompt {len(prompt_ids)} tokens", file=sys.stderr)
    print(f"# dtype {str(lm.dtype).removeprefix('torch.')}: {lm.dtype_reason}; prepack {lm.prepack}", file=sys.stderr)
    print(f"# sampling: {json.dumps(params.effective())}", file=sys.stderr)
    for step, event in enumerate(generate(lm.model, lm.tokenizer, prompt_ids, params, lm.eos_ids, lm.max_context)):
        if show:
            print(f"step {step:3d} -> {lm.tokenizer.decode([event.token_id])!r}")
            print(format_inspection(event.inspection, lm.tokenizer))
        else:
            print(event.text, end="", flush=True)
        if event.finish_reason:
            print(f"\n# finish_reason: {event.finish_reason}, {step + 1} tokens", file=sys.stderr)
    return 0


def format_inspection(inspection: Inspection, tokenizer) -> str:
    """One row per candidate, one column per stage; `*` marks the drawn token, `-` a stage that cut a token."""
    widths = [max(len(name), 5) + 2 for name in inspection.stages]
    lines = ["      " + " " * 18 + "".join(f"{name:>{w}}" for name, w in zip(inspection.stages, widths))]
    for token_id, probs in zip(inspection.token_ids, inspection.probs):
        mark = "*" if token_id == inspection.chosen else " "
        cells = "".join(f"{p:>{w}.3f}" if p > 0 else f"{'-':>{w}}" for p, w in zip(probs, widths))
        lines.append(f"    {mark} {repr(tokenizer.decode([token_id]))[:18]:<18}{cells}")
    return "\n".join(lines)
