"""What a JSON schema may ask of the grammar engine: the keywords it enforces, and what a schema may cost.

A schema is refused with a 400 naming the keyword and its place when the engine would not fully enforce it, or when
it is of a shape known to make grammar compiles slow: deep nesting (arrays nested 600 deep took 24.6 s), large
repetition bounds (`(a|b){0,N}` grows with the square of N: 8.5 s at 5,000; nested bounds multiply, sequential ones
add: 200 `[a-z]{0,1000}` in one pattern made a 26.9 MB grammar), many of them across the schema (20 properties of
`(a|b){0,1000}` each: 6.6 s on Qwen's vocabulary), or large enums (20,000 strings: 9.0 s and a 135 MB grammar).
Sizes add up over the whole schema (every tool's, for forced tool calls), so splitting a cost over many properties
does not pass. Whatever passes still compiles under a deadline and a memory limit (app/structured/grammar_compile.py).

The walk takes any JSON value (and values JSON cannot carry, from a caller in Python: NaN, ints of 5,000 digits):
a keyword of the wrong type is refused or left to the compiler, never an exception of its own (a `format` given as
a list was unhashable in the set lookup, a bound of 5,000 digits more than `int()` reads: both were 500s).
Counts saturate at `SATURATED`, so no message prints a number too long to print.
"""

from __future__ import annotations

import json
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
SATURATED = 10**18  # repetition counts stop growing here: far past any limit, and cheap to multiply and print
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
    max_repeat: int = 1000  # a pattern's repetition copies (nested bounds multiplied, sequential ones added)
    max_total_repeat: int = 4000  # the same, summed over every pattern and minItems / maxItems of the schema
    max_enum_values: int = 1000  # enum entries, summed over the schema
    max_literal_bytes: int = 32768  # enum and const values as JSON, summed over the schema
    compile_timeout_s: float = 10.0  # past this the compile is killed (app/structured/grammar_compile.py)
    workers: int = 1  # compile processes
    queue: int = 8  # compiles waiting for a worker beyond `workers`; past that, 429
    per_client: int = 2  # compiles running or waiting for any one client; past that, 429
    memory_bytes: int = 2**30  # address space a compile may add to its worker; past it, 400 and a new worker


@dataclass
class SchemaCost:
    """What the schema walked so far asks of the grammar, summed (one per request, shared by its schemas)."""

    repeat: int = 0
    enum_values: int = 0
    literal_bytes: int = 0


def _too_complex(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param=param, code="grammar_too_complex")


def check_schema(schema: Any, param: str, path: str = "", limits: GrammarLimits = GrammarLimits(),
                 depth: int = 0, cost: SchemaCost | None = None) -> SchemaCost:
    """Refuse a JSON schema the engine would not fully enforce, or that is too costly to compile, naming the
    keyword and where it is. `cost` sums the sizes over several schemas (a request's tools); the sums so far are
    returned."""
    cost = SchemaCost() if cost is None else cost
    if depth > limits.max_depth:
        raise InvalidRequest(f"JSON schema nests deeper than {limits.max_depth} levels (at {path}); flatten it or "
                             "raise GRAMMAR_MAX_DEPTH", param=param, code="grammar_too_complex")
    if isinstance(schema, bool):
        return cost
    if not isinstance(schema, dict):
        raise InvalidRequest(f"a JSON schema must be an object, got {type(schema).__name__} at {path or '/'}",
                             param=param)
    for key, value in schema.items():
        if not isinstance(key, str):  # JSON has none, a caller in Python may
            raise InvalidRequest(f"a JSON schema's keys are strings, got one of type {type(key).__name__} at "
                                 f"{path or '/'}", param=param)
        where = f"{path}/{key}"
        if key not in ENFORCED and key not in ANNOTATIONS:
            raise InvalidRequest(f"JSON schema keyword {shown(key)} (at {where}) cannot be enforced by this server",
                                 param=param)
        if key == "format" and (not isinstance(value, str) or value not in FORMATS):
            raise InvalidRequest(f"JSON schema format {shown(value)} (at {where}) cannot be enforced by this server; "
                                 f"supported: {', '.join(sorted(FORMATS))}", param=param)
        if key == "pattern" and not isinstance(value, str):
            raise InvalidRequest(f"JSON schema 'pattern' (at {where}) must be a string, got {type(value).__name__}",
                                 param=param)
        if key == "pattern" and ("minLength" in schema or "maxLength" in schema):
            raise InvalidRequest(f"JSON schema keyword 'pattern' together with minLength/maxLength (at {where}) "
                                 "cannot be enforced by this server; put the length into the pattern", param=param)
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise InvalidRequest(f"JSON schema keyword 'allOf' with more than one schema (at {where}) cannot be "
                                 "enforced by this server", param=param)
        repeat = pattern_repeat(value) if key == "pattern" else (
            min(max(value, 0), SATURATED) if key in ("minItems", "maxItems") and isinstance(value, int) else 0)
        if repeat > limits.max_repeat:
            raise _too_complex(f"JSON schema {key!r} (at {where}) repeats up to {repeat:,} times; at most "
                               f"{limits.max_repeat:,} (GRAMMAR_MAX_REPEAT), counting nested repetitions multiplied "
                               "and sequential ones added", param)
        cost.repeat += repeat
        if cost.repeat > limits.max_total_repeat:
            raise _too_complex(f"JSON schema repetitions add up to {cost.repeat:,} by {where}; at most "
                               f"{limits.max_total_repeat:,} over the whole schema (GRAMMAR_MAX_TOTAL_REPEAT)", param)
        if key in ("enum", "const"):
            _count_literals(key, value, where, param, limits, cost)
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, param, f"{where}/{name}", limits, depth + 1, cost)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, param, f"{where}/{i}", limits, depth + 1, cost)
        elif key in _SCHEMA_ONE:
            check_schema(value, param, where, limits, depth + 1, cost)
    return cost


def _count_literals(key: str, value: Any, where: str, param: str, limits: GrammarLimits, cost: SchemaCost) -> None:
    """Each enum entry is an alternative the grammar spells out in full, so entries and their bytes both count."""
    values = value if key == "enum" and isinstance(value, list) else [value]
    cost.enum_values += len(values) if key == "enum" else 0
    if cost.enum_values > limits.max_enum_values:
        raise _too_complex(f"JSON schema enums hold {cost.enum_values:,} values by {where}; at most "
                           f"{limits.max_enum_values:,} over the whole schema (GRAMMAR_MAX_ENUM_VALUES)", param)
    try:
        cost.literal_bytes += sum(len(json.dumps(v, ensure_ascii=False)) for v in values)
    except (ValueError, TypeError, RecursionError):  # NaN is fine; an int of 5,000 digits or 10,000 levels are not
        raise InvalidRequest(f"JSON schema {key!r} (at {where}) holds a value that is not JSON (too deep, or a "
                             "number too long)", param=param) from None
    if cost.literal_bytes > limits.max_literal_bytes:
        raise _too_complex(f"JSON schema enum and const values take {cost.literal_bytes:,} bytes by {where}; at "
                           f"most {limits.max_literal_bytes:,} over the whole schema (GRAMMAR_MAX_LITERAL_BYTES)",
                           param)


def pattern_repeat(pattern: str) -> int:
    """How many copies of a piece a regular expression's bounded repetitions make, as the grammar that expands
    them grows: `a{0,50}` is 50, `(a{0,30}){0,30}` is 900 (nested bounds multiply), `a{0,10}b{0,20}` is 30
    (sequential and alternative ones add). `*`, `+` and `?` are loops, not copies, so they count 0; an open bound
    `{m,}` counts m. Escapes and character classes are single atoms; a pattern without bounds counts 1."""
    stack = [[0, 0]]  # per open group: [copies in it so far, copies of the atom just read]
    i = 0
    while i < len(pattern):
        char = pattern[i]
        top = stack[-1]
        if char == "\\":
            i += 2
            top[1] = 0
            continue
        if char == "[":  # a class is one atom: skip to its closing bracket
            i += 1 + (pattern[i + 1 : i + 2] == "^")
            i += pattern[i : i + 1] == "]"  # a leading ] is a literal
            while i < len(pattern) and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            top[1] = 0
        elif char == "(":
            stack.append([0, 0])
        elif char == ")" and len(stack) > 1:
            inner = stack.pop()[0]
            stack[-1][0] = min(stack[-1][0] + inner, SATURATED)
            stack[-1][1] = inner
        elif char == "{" and (bound := _REPEAT.match(pattern, i)):
            low, comma, high = bound.groups()
            most = _count(high) if high else _count(low) if comma else 0
            copies = min(max(_count(low), most, 1) * max(top[1], 1), SATURATED)
            top[0] = min(top[0] + copies - top[1], SATURATED)  # the atom's own copies are now `copies` of it
            top[1] = copies
            i = bound.end()
            continue
        else:
            top[1] = 0
        i += 1
    return min(max(1, sum(group[0] for group in stack)), SATURATED)


def _count(digits: str) -> int:
    """A bound's digits as a number, saturated: `int()` refuses more than 4,300 digits, and needs none past 18."""
    return int(digits or 0) if len(digits) <= 18 else SATURATED


def shown(value: Any) -> str:
    """A keyword's value as an error message quotes it: a short string in full, anything else by its type."""
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:60] + "...")
    return f"of type {type(value).__name__}"


_REPEAT = re.compile(r"\{(\d*)(,?)(\d*)\}")
