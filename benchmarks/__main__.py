"""`python -m benchmarks generate | serve | compare | quality | ... | docs-figures`: the repository's benchmarks and
the docs' generated figures. They run from a clone (they read and write docs/, build peers, draw charts), so they
are not part of the `app` package that a wheel installs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from app.errors import ServeError

COMMANDS = {  # command -> (module under benchmarks/, help)
    "generate": ("generate", "our decode loop vs model.generate()"),
    "serve": ("serve", "drive any OpenAI-compatible server"),
    "compare": ("compare", "ours vs transformers serve and llama.cpp, same load"),
    "quality": ("quality", "perplexity and greedy agreement of bf16/int8"),
    "perplexity": ("perplexity", "a GGUF as we serve it against llama-perplexity on the same file and tokens"),
    "shortcuts": ("shortcuts", "prefix cache and n-gram speculation, on against off"),
    "grammar": ("grammar", "structured output: engines and cost"),
    "tools": ("tools", "tool-call parsing: total and worst per token"),
    "scaling": ("scaling", "Qwen2.5 0.5B-7B shapes (random weights): ours at the defaults, int8 and int4 against "
                           "llama.cpp's Q4_K_M and Q8_0: tokens/s, TTFT, long-context decode, resident memory"),
    "lora": ("lora", "a LoRA adapter against the base model: tokens/s at 1 and 8 streams, mixed batches too"),
    "step": ("step", "one decode step: eager against DECODE_STEP=compiled"),
    "batch": ("batch", "interactive first token and tokens/s alone and while a batch runs (Batches API)"),
    "soak": ("soak", "a long mixed load, then checks that the server held up (exit 1 if not)"),
    "docs-figures": ("docs", "rewrite the docs' generated tables and redraw their charts from docs/results/ "
                             "and app/config.py"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (module, help) in COMMANDS.items():
        sub = commands.add_parser(name, help=help)
        if argv[:1] == [name]:  # only the chosen bench is imported: most pull in torch, some the server
            importlib.import_module(f"benchmarks.{module}").add_arguments(sub)
    args = parser.parse_args(argv)
    try:
        code = importlib.import_module(f"benchmarks.{COMMANDS[args.command][0]}").run(args)
        return code if isinstance(code, int) else 0  # soak returns its exit code; some benches return their report
    except ServeError as err:
        where = f" (parameter: {err.param})" if err.param else ""
        print(f"error: {err.message}{where}", file=sys.stderr)
        return 2
    except ValueError as err:  # pydantic's ValidationError names the setting
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
