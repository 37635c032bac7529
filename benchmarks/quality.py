"""`python -m benchmarks quality`: how far faster variants (bf16, int8 weights) stray from the fp32 model.

Two measures, against the unquantized fp32 model as the reference:
- perplexity on a fixed text kept in the repo (benchmarks/data/quality.txt: public-domain English and some Python);
- greedy agreement: the reference's own greedy continuation of a few prompts is fed to the variant (teacher
  forcing), which counts how often the variant's top token is the reference's; and, generating freely, how many
  tokens the variant's greedy output stays identical to the reference's.
The 8-bit KV cache's cost, as served, is `bench perplexity`'s.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from benchmarks import record
from app.config import Settings
from app.models.loading import load_model

TEXT = Path(__file__).with_name("data") / "quality.txt"
PROMPTS = (
    "Which city is the capital of France? Answer, then describe the city in a few paragraphs.",
    "Write a Python function that checks whether a string is a palindrome, with a docstring and two tests.",
    "Explain in simple words why the sky is blue.",
    "用中文简单介绍一下长城。",
)
VARIANTS = {  # name -> (dtype, quant)
    "bf16": ("bfloat16", "none"),
    "int8": ("auto", "int8"),
    "int8-weight-only-bf16": ("bfloat16", "int8"),
    "int4": ("auto", "int4"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: $MODEL or the embedded default")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    parser.add_argument("--text", default=str(TEXT), help="the perplexity text (default: benchmarks/data/quality.txt, "
                        "short: a longer one resolves smaller differences)")
    parser.add_argument("--out", default=None, help="also write the figures as JSON here")


@torch.inference_mode()
def perplexity(model, ids: list[int], window: int) -> float:
    """exp(mean negative log-likelihood) over the text, in non-overlapping windows of `window` tokens."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start:start + window + 1]], device=model.device)
        logits = model(chunk[:, :-1]).logits.float()
        nll += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    return math.exp(nll / count)


@torch.inference_mode()
def greedy_tokens(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                         min_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def teacher_forced_agreement(model, prompt_ids: list[int], continuation: list[int]) -> int:
    """Positions of `continuation` where the model's top token, given the reference's prefix, is the reference's."""
    ids = torch.tensor([prompt_ids + continuation], device=model.device)
    logits = model(ids).logits[0, len(prompt_ids) - 1:-1]
    return int((logits.argmax(-1).cpu() == torch.tensor(continuation)).sum())


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def evaluate(lm, text_ids: list[int], prompts: list[list[int]], reference: list[list[int]] | None,
             max_tokens: int, window: int) -> dict:
    result = {"perplexity": perplexity(lm.model, text_ids, window)}
    greedy = [greedy_tokens(lm.model, p, max_tokens) for p in prompts]
    if reference is None:
        result["greedy"] = greedy
        return result
    result["teacher_forced_agreement"] = sum(
        teacher_forced_agreement(lm.model, p, r) for p, r in zip(prompts, reference)) / sum(map(len, reference))
    result["identical_prefix_tokens"] = [common_prefix(g, r) for g, r in zip(greedy, reference)]
    return result


def run(args: argparse.Namespace) -> dict:
    settings = Settings(**({"model": args.model} if args.model else {}))
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"error: --variants: unknown {', '.join(unknown)}; pick from {', '.join(VARIANTS)}")
    torch.set_grad_enabled(False)

    def load(dtype: str, quant: str):
        return load_model(settings.model, "cpu", dtype, settings.model_cache, prepack="auto", quant=quant)

    lm = load("float32", "none")
    text_ids = lm.encode_text(Path(args.text).read_text())
    prompts = [lm.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    ref = evaluate(lm, text_ids, prompts, None, args.max_tokens, args.window)
    report = {**record.envelope("quality", args), "model": settings.model, "text_tokens": len(text_ids),
              "max_tokens": args.max_tokens,
              "variants": {"fp32 (reference)": {"perplexity": ref["perplexity"]}}}
    del lm
    for name in names:
        variant = load(*VARIANTS[name])
        report["variants"][name] = evaluate(variant, text_ids, prompts, ref["greedy"], args.max_tokens, args.window)
        report["variants"][name]["dtype"] = str(variant.dtype)
        report["variants"][name]["vs_fp32"] = report["variants"][name]["perplexity"] / ref["perplexity"] - 1
        del variant
    print_report(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


def print_report(r: dict) -> None:
    print(f"model {r['model']}: perplexity over {r['text_tokens']} tokens of {r['settings']['text']}; greedy "
          f"agreement with fp32 over {len(PROMPTS)} prompts x {r['max_tokens']} tokens")
    ref = r["variants"]["fp32 (reference)"]["perplexity"]
    print(f"{'variant':26}{'perplexity':>12}{'vs fp32':>9}{'top-1 agreement':>17}  identical greedy tokens")
    for name, v in r["variants"].items():
        agreement = v.get("teacher_forced_agreement")
        prefix = v.get("identical_prefix_tokens")
        print(f"{name:26}{v['perplexity']:>12.3f}{v['perplexity'] / ref - 1:>+9.2%}"
              f"{'-' if agreement is None else f'{agreement:.1%}':>17}  {'-' if prefix is None else prefix}")
