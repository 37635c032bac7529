"""`python -m benchmarks tools`: what tool-call parsing costs per token on a long call.

An agent's "write file" call can be tens of thousands of characters, parsed token by token on the event loop, so
the figure that matters is the worst single token (every other stream and /health wait for it), next to the
total. The call is split into the real tokenizer's tokens when the model is in the local cache (no download),
else into fixed 4-character pieces. Each format's parser takes the same call: Hermes (`<tool_call>` tags) and the
bare-JSON habit.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from app.config import Settings
from app.openai.tools import collect, make_parser

# Code with the characters that a JSON-aware scan must mind: quotes, backslashes, braces, and the closing tag.
LINE = 'def f(x):\n    return {"x": [x, \'</tool_call>\', "a\\\\b"]}  # {[( \n'


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chars", type=int, default=50_000, help="length of the file content in the call")
    parser.add_argument("--model", default=None, help="whose tokenizer splits the call (default: $MODEL, from the "
                                                      "local cache; fixed 4-character pieces if it is not there)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per format; the best total is shown")


def call_text(chars: int, fmt: str) -> str:
    content = (LINE * (chars // len(LINE) + 1))[:chars]
    body = json.dumps({"name": "write_file", "arguments": {"path": "src/big.py", "content": content}})
    return f"<tool_call>\n{body}\n</tool_call>" if fmt == "hermes" else body


def split(text: str, model: str, cache: Path) -> tuple[list[str], str]:
    """The text as the model's tokens (by their character offsets, so no text is changed), or 4-character pieces."""
    path = Path(model).expanduser() if Path(model).expanduser().is_dir() else cache / model
    if (path / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        cuts = sorted({start for start, _ in offsets} | {0, len(text)})
        return [text[a:b] for a, b in zip(cuts, cuts[1:])], f"{path.name}'s tokenizer"
    return [text[i:i + 4] for i in range(0, len(text), 4)], "4-character pieces (no tokenizer in the cache)"


def time_parse(pieces: list[str], fmt: str) -> tuple[float, list[float], int]:
    """Feed the pieces one by one as the server does: (total seconds, each piece's seconds, calls found)."""
    parser = make_parser(fmt, ["write_file"])
    items, times = [], []
    start = time.perf_counter()
    for i, piece in enumerate(pieces):
        before = time.perf_counter()
        items += parser.feed(piece)
        if i == len(pieces) - 1:
            items += parser.finish()  # the last token also parses the call
        times.append(time.perf_counter() - before)
    return time.perf_counter() - start, times, len(collect(items).tool_calls)


def run(args: argparse.Namespace) -> None:
    settings = Settings()
    print(f"tool-call parsing, a write_file call with {args.chars:,} characters of content; per token: p99, worst, "
          "and the last one (which parses the whole call). A busy machine's scheduler shows up in the worst.")
    for fmt in ("hermes", "json"):
        text = call_text(args.chars, fmt)
        pieces, how = split(text, args.model or settings.model, settings.model_cache)
        total, times, calls = min(time_parse(pieces, fmt) for _ in range(args.repeat))
        assert calls == 1, f"{fmt}: the call was not parsed"
        p99 = sorted(times)[int(0.99 * (len(times) - 1))]
        print(f"  {fmt:6s} {len(text):,} chars in {len(pieces):,} tokens ({how}): total {total * 1e3:.1f} ms; "
              f"per token p99 {p99 * 1e6:.1f} us, worst {max(times) * 1e3:.2f} ms, last {times[-1] * 1e3:.2f} ms")
