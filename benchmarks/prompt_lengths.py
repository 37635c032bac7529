"""`bench scaling --prompt-lens 128,2048`: prompts of a given length in tokens, the same texts for every server.

The prompts are the bench's passages (benchmarks/serve.py), counted with the model's own tokenizer when its
directory has one (else serve.py's estimate), each opened by a tag unique to its length and request. The tag comes
first because both prompt caches match from the start and stop at the first token that differs: ours reuses whole
16-token blocks of an earlier prompt, llama.cpp a slot's longest common prefix. So neither can serve a prompt from
another one; only the chat template's header and the tag's first few tokens ("Prompt 2048-"), the same for every
server, can be reused.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks import serve as bench_serve


def parse(text: str) -> list[int]:
    """`--prompt-lens`: comma-separated token counts, ascending, without repeats; [] when empty."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"error: --prompt-lens: expected comma-separated token counts such as 128,2048, "
                         f"got {text!r}")
    return sorted({int(p) for p in parts})


def token_counter(model_dir: Path):
    """The model's tokenizer as a counter, and what counted: the requested lengths are the user message's tokens."""
    if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file():
        return bench_serve.tokenizer_counter(model_dir), "the model's tokenizer"
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
