"""What a JSON schema may ask of the grammar engine: the keywords it enforces, and what a schema may cost.

A schema is refused with a 400 naming the keyword and its place when the engine would not fully enforce it, or when
it is of a shape known to make grammar compiles slow: deep nesting (arrays nested 600 deep took 24.6 s) or large
repetition bounds (`(a|b){0,N}` grows with the square of N: 8.5 s at 5,000; nested bounds multiply). Whatever
passes still compiles under a deadline (app/core/grammar_compile.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from app.errors import InvalidRequest

# JSON Schema keywords the engine enforces, or that only annotate; anything else is refused with a 400, never
# silently ignored (xgrammar warns and ignores `not`, `if`, multi-entry `allOf`, unknown formats, ...).
ENFORCED = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "uniqueItems", "contains", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "minProperties", "maxProperties", "propertyNames", "patternProperties", "dependentRequired",
    "unevaluatedProperties", "unevaluatedItems",
}
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "strict", "nullable", "discriminator", "contentMediaType"}
FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uri", "uri-reference",
           "uri-template", "json-pointer", "relative-json-pointer", "uuid"}
# Keywords whose value is a map of name -> subschema, or a list of subschemas, or one subschema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedProperties",
               "unevaluatedItems")


@dataclass(frozen=True)
class GrammarLimits:
    """What one request's grammar may cost before it is compiled, and how long its compile may take. Each is a
    setting (app/config.py); going over one is a 400 that names the field."""

    max_depth: int = 32  # nested subschemas (objects in arrays in ...); OpenAI allows 10 levels
    max_repeat: int = 1000  # a pattern's repetition bound, or the product of nested ones; minItems / maxItems
    compile_timeout_s: float = 10.0  # past this the compile is killed (app/core/grammar_compile.py)
    workers: int = 1  # compile processes
    queue: int = 8  # compiles waiting for a worker beyond `workers`; past that, 429


def check_schema(schema: Any, param: str, path: str = "", limits: GrammarLimits = GrammarLimits(),
                 depth: int = 0) -> None:
    """Refuse a JSON schema the engine would not fully enforce, or that is too costly to compile, naming the
    keyword and where it is."""
    if depth > limits.max_depth:
        raise InvalidRequest(f"JSON schema nests deeper than {limits.max_depth} levels (at {path}); flatten it or "
                             "raise GRAMMAR_MAX_DEPTH", param=param, code="grammar_too_complex")
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidRequest(f"a JSON schema must be an object, got {type(schema).__name__} at {path or '/'}",
                             param=param)
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key not in ENFORCED and key not in ANNOTATIONS:
            raise InvalidRequest(f"JSON schema keyword {key!r} (at {where}) cannot be enforced by this server",
                                 param=param)
        if key == "format" and value not in FORMATS:
            raise InvalidRequest(f"JSON schema format {value!r} (at {where}) cannot be enforced by this server; "
                                 f"supported: {', '.join(sorted(FORMATS))}", param=param)
        if key == "pattern" and ("minLength" in schema or "maxLength" in schema):
            raise InvalidRequest(f"JSON schema keyword 'pattern' together with minLength/maxLength (at {where}) "
                                 "cannot be enforced by this server; put the length into the pattern", param=param)
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise InvalidRequest(f"JSON schema keyword 'allOf' with more than one schema (at {where}) cannot be "
                                 "enforced by this server", param=param)
        repeat = pattern_repeat(value) if key == "pattern" and isinstance(value, str) else (
            value if key in ("minItems", "maxItems") and isinstance(value, int) else 0)
        if repeat > limits.max_repeat:
            raise InvalidRequest(f"JSON schema {key!r} (at {where}) repeats up to {repeat:,} times; at most "
                                 f"{limits.max_repeat:,} (GRAMMAR_MAX_REPEAT), counting nested repetitions "
                                 "multiplied", param=param, code="grammar_too_complex")
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, param, f"{where}/{name}", limits, depth + 1)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, param, f"{where}/{i}", limits, depth + 1)
        elif key in _SCHEMA_ONE:
            check_schema(value, param, where, limits, depth + 1)


def pattern_repeat(pattern: str) -> int:
    """The largest number of times a regular expression's bounded repetitions make one piece repeat: `a{0,50}` is
    50, `(a{0,30}){0,30}` is 900 (nested bounds multiply, as the grammar that expands them grows). `*`, `+` and
    `?` are loops, not copies, so they count 1; an open bound `{m,}` counts m. Escapes and character classes are
    single atoms."""
    stack = [[1, 1]]  # per open group: [largest factor inside it so far, factor of the atom just read]
    worst, i = 1, 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            stack[-1][1] = 1
            continue
        if char == "[":  # a class is one atom: skip to its closing bracket
            i += 1 + (pattern[i + 1 : i + 2] == "^")
            i += pattern[i : i + 1] == "]"  # a leading ] is a literal
            while i < len(pattern) and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            stack[-1][1] = 1
        elif char == "(":
            stack.append([1, 1])
        elif char == ")" and len(stack) > 1:
            inner = stack.pop()[0]
            stack[-1][1] = inner
            stack[-1][0] = max(stack[-1][0], inner)
        elif char == "{" and (bound := _REPEAT.match(pattern, i)):
            low, comma, high = bound.groups()
            factor = stack[-1][1] * max(int(low or 0), int(high) if high else int(low or 0) if comma else 0, 1)
            stack[-1][1] = factor
            stack[-1][0] = max(stack[-1][0], factor)
            worst = max(worst, factor)
            i = bound.end()
            continue
        else:
            stack[-1][1] = 1
        i += 1
    return max([worst] + [group[0] for group in stack])


_REPEAT = re.compile(r"\{(\d*)(,?)(\d*)\}")
