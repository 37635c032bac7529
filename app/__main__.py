"""`python -m app serve | generate | batch | fetch-model`: the server, the decode loop on a terminal, a batch file
run offline, and the model fetch.

The benchmarks and the docs' figures are the repository's tools, not the package's: `python -m benchmarks`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import ValidationError

from app.config import Settings
from app.errors import ServeError
from app.flags import add_settings_flags, settings_from
from app.gpu_only_imports import skip_triton_without_cuda
from app.models.distributed import launched_rank

# the settings `python -m app batch` takes as flags (env vars set the rest, as for `serve`)
BATCH_FLAGS = ("model", "served_model_name", "device", "dtype", "prepack", "quant", "max_active", "max_model_len",
               "default_max_tokens", "batch_max_lines")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_settings_flags(serve)  # every Settings field, with its description as help

    gen = commands.add_parser("generate", help="stream one answer to the terminal")
    gen.add_argument("prompt")
    add_settings_flags(gen, ("model", "device", "dtype", "prepack", "quant"))
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
    gen.add_argument("--show-logits", nargs="?", const=5, type=int, metavar="K",
                     help="print each step's top K candidates with their probability at every stage: raw, "
                          "penalties, temperature, top_k, top_p, min_p (default 5)")

    batch = commands.add_parser("batch", help="run a Batches API input file offline, with a progress bar")
    batch.add_argument("input", type=Path, metavar="INPUT.jsonl", help="one request a line: custom_id, method, "
                       "url, body (OpenAI's batch input format)")
    batch.add_argument("-o", "--output", type=Path, required=True, metavar="OUTPUT.jsonl",
                       help="the answers, one line per request, in the Batches API's output format")
    batch.add_argument("--resume", action="store_true", help="continue OUTPUT: skip the custom_ids already in it")
    add_settings_flags(batch, BATCH_FLAGS)

    fetch = commands.add_parser("fetch-model", help="download and convert an embedded model")
    fetch.add_argument("names", nargs="*", help="embedded model names (default: $MODEL or the default model)")

    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            settings = settings_from(args)  # a bad flag is refused before the server's imports
            skip_triton_without_cuda(settings.device)
            from app.server import run_server, run_tensor_parallel_follower

            if settings.tensor_parallel > 1 and launched_rank(settings.tensor_parallel) > 0:
                return run_tensor_parallel_follower(settings)  # rank 0 serves; the others run its passes
            return run_server(settings)
        if args.command == "generate":
            settings = settings_from(args, keys=("model", "device", "dtype", "prepack", "quant"))
            skip_triton_without_cuda(settings.device)
            from app.cli import run_generate

            return run_generate(args, settings)
        if args.command == "batch":
            settings = settings_from(args, keys=BATCH_FLAGS)
            skip_triton_without_cuda(settings.device)
            from app.batch.cli import run_batch

            return run_batch(args.input, args.output, args.resume, settings)
        if args.command == "fetch-model":
            from app.models.fetch import fetch_model

            settings = Settings()
            for name in args.names or [settings.model]:
                print(fetch_model(name, settings.model_cache))
        return 0
    except ServeError as err:
        where = f" (parameter: {err.param})" if err.param else ""
        print(f"error: {err.message}{where}", file=sys.stderr)
        return 2
    except ValidationError as err:  # each problem, naming its setting; never pydantic's echo of the inputs,
        for problem in err.errors():  # which would print API_KEY to the terminal
            setting = ".".join(str(part) for part in problem["loc"])
            message = problem["msg"].removeprefix("Value error, ")
            print(f"error: {setting + ': ' if setting else ''}{message}", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
