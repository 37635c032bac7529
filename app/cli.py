"""`python -m app generate`: the decode loop on the terminal, optionally showing each step's candidates."""

from __future__ import annotations

import argparse
import json
import sys

from app.config import Settings
from app.core.generate import generate
from app.models.loading import load_model
from app.core.sampling import resolve_sampling_params

SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "max_tokens", "seed", "stop")


def run_generate(args: argparse.Namespace, settings: Settings) -> int:
    lm = load_model(settings.model, settings.device, settings.dtype, settings.model_cache, prepack=settings.prepack)
    request = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}
    params = resolve_sampling_params(request, lm.generation_defaults)
    if args.raw:
        prompt_ids = lm.encode_text(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt_ids = lm.encode_chat(messages + [{"role": "user", "content": args.prompt}])
    print(f"# {lm.name} on {lm.device} ({lm.dtype}), prompt {len(prompt_ids)} tokens", file=sys.stderr)
    print(f"# sampling: {json.dumps(params.effective())}", file=sys.stderr)
    show = args.show_logits or 0
    for step, event in enumerate(generate(lm.model, lm.tokenizer, prompt_ids, params, lm.eos_ids, lm.max_context,
                                          show_candidates=show)):
        if show:
            candidates = "  ".join(f"{lm.tokenizer.decode([t])!r} {p:.3f}" for t, p in event.candidates)
            print(f"step {step:3d} -> {lm.tokenizer.decode([event.token_id])!r:14}| {candidates}")
        else:
            print(event.text, end="", flush=True)
        if event.finish_reason:
            print(f"\n# finish_reason: {event.finish_reason}, {step + 1} tokens", file=sys.stderr)
    return 0
