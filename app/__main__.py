"""`python -m app serve | generate | fetch-model | docs-figures | bench generate | serve | compare | step | ...`."""

from __future__ import annotations

import argparse
import sys

from app.config import DEFAULT_MODEL, Settings
from app.errors import ServeError
from app.models.distributed import launched_rank


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    for flag in ("--model", "--served-model-name", "--host", "--device", "--dtype", "--api-key", "--log-level",
                 "--model-cache", "--quant"):
        serve.add_argument(flag)
    for flag in ("--port", "--max-active", "--max-queue", "--max-model-len", "--max-request-bytes",
                 "--default-max-tokens", "--prefill-tokens-per-step", "--tensor-parallel"):
        serve.add_argument(flag, type=int)
    serve.add_argument("--kv-cache-bytes", help="KV cache budget, e.g. 8GiB (default: from free memory)")
    serve.add_argument("--shutdown-grace-s", type=float)
    serve.add_argument("--cors-origins", help="comma-separated origins")
    serve.add_argument("--prefix-cache-bytes", help="prefix cache size, e.g. 1GiB; 0 turns it off (default 512MiB)")
    serve.add_argument("--speculative", help="ngram (default) | off: n-gram speculative decoding")
    serve.add_argument("--decode-step", help="eager (default) | compiled: decode steps of fixed shapes over a KV "
                       "pool, compiled at start (not used while the prefix cache or speculation is on)")
    add_prepack_flags(serve)

    gen = commands.add_parser("generate", help="stream one answer to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help=f"default: $MODEL or {DEFAULT_MODEL}")
    gen.add_argument("--system", default=None, help="optional system message")
    gen.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--min-p", type=float)
    gen.add_argument("--repetition-penalty", type=float)
    gen.add_argument("--presence-penalty", type=float)
    gen.add_argument("--frequency-penalty", type=float)
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--seed", type=int)
    gen.add_argument("--device")
    gen.add_argument("--dtype")
    add_prepack_flags(gen)
    gen.add_argument("--quant", help="none | int8")
    gen.add_argument("--show-logits", nargs="?", const=5, type=int, metavar="K",
                     help="print each step's top K candidates with their probability at every stage: raw, "
                          "penalties, temperature, top_k, top_p, min_p (default 5)")

    docs = commands.add_parser("docs-figures", help="rewrite docs/' generated tables and draw its charts "
                               "from docs/results/ and app/config.py")
    docs.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page differs")

    fetch = commands.add_parser("fetch-model", help="download and convert an embedded model")
    fetch.add_argument("names", nargs="*", help="embedded model names (default: $MODEL or the default model)")

    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="bench_command", required=True)
    # the benchmarks are optional leaves of the CLI
    from app.bench import (compare as bench_compare, generate as bench_generate, grammar as bench_grammar,
                           quality as bench_quality, serve as bench_serve, shortcuts as bench_shortcuts,
                           soak as bench_soak, step as bench_step, tools as bench_tools)
    from app.bench import routing as bench_routing

    bench_generate.add_arguments(bench_kinds.add_parser("generate", help="our decode loop vs model.generate()"))
    bench_serve.add_arguments(bench_kinds.add_parser("serve", help="drive any OpenAI-compatible server"))
    bench_compare.add_arguments(bench_kinds.add_parser("compare", help="ours vs transformers serve, same load"))
    bench_quality.add_arguments(bench_kinds.add_parser("quality", help="perplexity and greedy agreement of bf16/int8"))
    bench_shortcuts.add_arguments(bench_kinds.add_parser("shortcuts", help="prefix cache and n-gram speculation, "
                                                         "on against off"))
    bench_grammar.add_arguments(bench_kinds.add_parser("grammar", help="structured output: engines and cost"))
    bench_tools.add_arguments(bench_kinds.add_parser("tools", help="tool-call parsing: total and worst per token"))
    bench_step.add_arguments(bench_kinds.add_parser("step", help="one decode step: eager against DECODE_STEP=compiled"))
    bench_soak.add_arguments(bench_kinds.add_parser("soak", help="a long mixed load, then checks that the server "
                                                    "held up (exit 1 if not)"))
    bench_routing.add_arguments(bench_kinds.add_parser("routing", help="round-robin vs prefix-aware routing over N "
                                                       "local replicas (stands in for the inference gateway)"))

    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            from app.main import run_server, run_tensor_parallel_follower

            settings = settings_from(args)
            if settings.tensor_parallel > 1 and launched_rank(settings.tensor_parallel) > 0:
                return run_tensor_parallel_follower(settings)  # rank 0 serves; the others run its passes
            return run_server(settings)
        if args.command == "generate":
            from app.cli import run_generate

            return run_generate(args, settings_from(args, keys=("model", "device", "dtype", "prepack", "quant")))
        if args.command == "docs-figures":
            from app.docs import main as docs_figures

            return docs_figures(["--check"] if args.check else [])
        if args.command == "fetch-model":
            from app.models.fetch import fetch_model

            settings = Settings()
            for name in args.names or [settings.model]:
                print(fetch_model(name, settings.model_cache))
            return 0
        if args.bench_command == "generate":
            bench_generate.run(args)
        elif args.bench_command == "compare":
            bench_compare.run(args)
        elif args.bench_command == "quality":
            bench_quality.run(args)
        elif args.bench_command == "shortcuts":
            bench_shortcuts.run(args)
        elif args.bench_command == "grammar":
            bench_grammar.run(args)
        elif args.bench_command == "tools":
            bench_tools.run(args)
        elif args.bench_command == "step":
            bench_step.run(args)
        elif args.bench_command == "soak":
            return bench_soak.run(args)
        elif args.bench_command == "routing":
            bench_routing.run(args)
        else:
            bench_serve.run(args)
        return 0
    except ServeError as err:
        where = f" (parameter: {err.param})" if err.param else ""
        print(f"error: {err.message}{where}", file=sys.stderr)
        return 2
    except ValueError as err:  # pydantic's ValidationError names the setting
        print(f"error: {err}", file=sys.stderr)
        return 2


def add_prepack_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prepack", nargs="?", const="true", choices=("auto", "true", "false"),
                        help="CPU: reorder linear weights once for oneDNN, bf16 in place, fp32 as a copy for "
                             "batched rows (default: auto, where it can; a bare --prepack means true: fail at start "
                             "where it cannot)")
    parser.add_argument("--no-prepack", dest="prepack", action="store_const", const="false")


def settings_from(args: argparse.Namespace, keys: tuple[str, ...] | None = None) -> Settings:
    """CLI flags override env vars, which override defaults."""
    given = {k: v for k, v in vars(args).items() if v is not None and (keys is None or k in keys)}
    return Settings(**{k: v for k, v in given.items() if k in Settings.model_fields})


if __name__ == "__main__":
    sys.exit(main())
