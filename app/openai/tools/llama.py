"""Meta Llama's two tool-call formats.

  * llama3_json (Llama 3.1 / 3.2 / 3.3 templates): `{"name": ..., "parameters": {...}}`, the whole answer, maybe
    after `<|python_tag|>`; several calls are separated by `;` (as vLLM's llama3_json parser reads them).
  * pythonic (Llama 3.2 1B/3B with vLLM's pythonic template, Llama 4): `[get_weather(city="Paris"), f(a=1)]`, the
    whole answer, maybe inside `<|python_start|>...<|python_end|>`. Read with `ast`: keyword arguments whose values
    are Python literals (strings, numbers, True/False/None, lists, dicts); nothing is ever evaluated. A value JSON
    cannot hold (a set, bytes, a complex number, an infinite float) makes the answer text.

Both are the whole answer, so a maybe-call is held back until the answer ends (only the end tells a call from a
JSON or a Python list answer), as the bare-JSON parser does.
"""

from __future__ import annotations

import ast
import json

from app.openai.tools.base import DECODER, WHITESPACE, call_from_json
from app.openai.tools.sections import SectionParser

PYTHON_TAG = "<|python_tag|>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class Llama3JsonToolParser(SectionParser):
    OPENS = (PYTHON_TAG,)
    BARE_START = "{"

    def parse_section(self, text: str) -> list[tuple[str, str]] | None:
        text = text.strip().removeprefix(PYTHON_TAG)
        calls, i = [], WHITESPACE.match(text, 0).end()
        while i < len(text):
            try:
                obj, i = DECODER.raw_decode(text, i)
            except (ValueError, RecursionError):
                return None
            call = call_from_json(obj, self.tool_names)
            if call is None:
                return None
            calls.append(call)
            i = WHITESPACE.match(text, i).end()
            if text[i:i + 1] == ";":  # the separator between calls
                i = WHITESPACE.match(text, i + 1).end()
        return calls or None


class _NotLiteral(Exception):
    pass


def _literal(node: ast.expr):
    """A Python literal as JSON's value: strings, numbers, True/False/None, and lists, tuples and dicts of them."""
    value = ast.literal_eval(node)  # literals only: never evaluates a name, call or operator beyond +/- on numbers
    if isinstance(value, (set, frozenset, bytes, complex)):
        raise _NotLiteral
    return value


def pythonic_calls(text: str, tool_names: frozenset[str]) -> list[tuple[str, str]] | None:
    """`[f(a=1), g(b="x")]` -> [(name, arguments JSON)], or None unless every element is a call of an offered tool
    with keyword arguments whose values are literals."""
    text = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
    try:
        tree = ast.parse(text, mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            if (tool_names and node.func.id not in tool_names) or any(k.arg is None for k in node.keywords):
                return None  # an unknown tool, or **kwargs
            args = {k.arg: _literal(k.value) for k in node.keywords}
            calls.append((node.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False)))
        return calls
    # SyntaxError, ValueError (not a literal; NaN), TypeError (a list as a dict key), MemoryError and RecursionError
    # (nesting deeper than the parser's stack): all say the text is no call
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError, _NotLiteral):
        return None


class PythonicToolParser(SectionParser):
    OPENS = (PYTHON_START,)
    BARE_START = "["
    STRING_AWARE = False  # Python strings may be single-quoted: the end marker is looked for anywhere

    def close_for(self, marker: str) -> str | None:
        return PYTHON_END

    def parse_section(self, text: str) -> list[tuple[str, str]] | None:
        return pythonic_calls(text, self.tool_names)

