"""Request bodies: JSON parsed, bounded and validated on a prepare worker (app/prepare.py), never on the event loop.

The checks run cheapest first, so a hostile body is refused before it costs much:
1. a JSON content type (a form post from a web page is no JSON: no simple-request CSRF);
2. nesting depth (`MAX_JSON_DEPTH`) and the length of the top-level lists (`MAX_MESSAGES`, `MAX_TOOLS`), from the
   raw bytes (`json_shape`): `bytes.translate` and numpy, 64 KiB at a time, ~5 ms for 1 MiB of 31,000 small
   messages where json.loads holds the GIL for ~19 ms; a bomb of 500,000 `[` never reaches the recursive parser;
3. UTF-8, then `json.loads`, refusing NaN, Infinity and numbers too large for a float: JSON has none of them, and a NaN that
   got in was echoed back as bare `NaN`, which strict parsers reject;
4. item counts (`MAX_MESSAGES`, `MAX_CONTENT_BLOCKS`, `MAX_TOOLS`) on the parsed dict, before pydantic: validating
   31,000 messages cost ~100 ms of GIL per body;
   a request model's own `LIST_BOUNDS` replace these bounds for its fields in 2 and 4 (the pooling routes: their
   `input` is texts or token ids, not messages);
5. pydantic, whose errors become the same 400 as FastAPI's own validation errors (app/main.py).
"""

from __future__ import annotations

import bisect
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator, TypeVar

import numpy as np
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from app.errors import InvalidRequest

M = TypeVar("M", bound=BaseModel)
QUOTE, BACKSLASH = 34, 92
MARKS = b'[]{},"'  # the bytes json_shape reads: what nests, what separates items, what opens and closes strings
UNMARKED = bytes(sorted(set(range(256)) - set(MARKS)))
IS_MARK = np.zeros(256, bool)
IS_MARK[list(MARKS)] = True
STEP = np.zeros(256, np.int32)  # what a byte outside strings does to the nesting depth
STEP[list(b"[{")], STEP[list(b"]}")] = 1, -1
CHUNK = 1 << 16
NOT_BACKSLASH = re.compile(rb'[^\\]')
KEY_BEFORE = re.compile(rb'"([^"]{1,64})"\s*:\s*\Z')  # the key whose value opens where this text ends


@dataclass(frozen=True)
class BodyLimits:
    max_depth: int = 128
    max_messages: int = 2048
    max_content_blocks: int = 8192
    max_tools: int = 128


def json_shape(raw: bytes, at_least: int) -> tuple[int, dict[str, int]]:
    """How deep arrays and objects nest in this JSON text, and how many items each top-level key's array or object
    holds when that is over `at_least`; read from the bytes, without parsing (for text that is not JSON: numbers
    that mean nothing). ~5 ms for 1 MiB of 31,000 small messages, where json.loads holds the GIL for ~19 ms, and
    the recursive parser meets the nesting only once it is built.

    `bytes.translate` keeps the bytes that matter (brackets, braces, commas, quotes) and numpy reads those, 64 KiB
    of the body at a time: numpy over the whole body at once cost twice its arithmetic again in page faults, each
    1 MiB temporary a fresh mmap (1,600 faults and 6 ms of system time a body on a 2-core VM); a chunk's temporaries
    come from the heap and are reused."""
    quotes_before = depth_before = deepest = tops = 0
    owners = []  # per chunk: the top-level container each comma directly inside one belongs to
    opened = []  # per chunk: (its bounds, the indices among its marks at which top-level containers open)
    starts = []  # where each chunk begins
    for bounds in chunks(raw):
        starts.append(bounds[0])
        marks = np.frombuffer(unescaped(raw, *bounds).translate(None, UNMARKED), np.uint8)
        quotes = marks == QUOTE
        outside = ~quotes & (((np.cumsum(quotes, dtype=np.int32) + quotes_before) & 1) == 0)
        quotes_before += int(np.count_nonzero(quotes))
        steps = STEP[marks[outside]]
        if steps.size == 0:
            continue
        depth = np.cumsum(steps, dtype=np.int32)  # after each bracket or comma; an int64 accumulator costs 10x
        depth += depth_before
        depth_before, deepest = int(depth[-1]), max(deepest, int(depth.max()))
        # top-level values that are arrays or objects open at depth 2; their items are separated by commas at depth 2
        top = (steps == 1) & (depth == 2)
        if top.any():
            opened.append((bounds, np.flatnonzero(outside)[np.flatnonzero(top)]))
        owner = np.cumsum(top, dtype=np.int32)
        owner += tops - 1
        tops = int(owner[-1]) + 1
        owners.append(owner[(steps == 0) & (depth == 2)])
    if not opened:
        return deepest, {}
    items = np.bincount(np.concatenate(owners), minlength=tops) + 1
    counts: dict[str, int] = {}
    first = 0
    for (start, end), at in opened:  # the key before each container over `at_least`, from its place among the marks
        if (over := np.flatnonzero(items[first:first + at.size] > at_least)).size:
            before = starts[max(0, bisect.bisect_right(starts, start - 80) - 1)]  # a chunk's start, 80 bytes back
            text = unescaped(raw, before, end)
            chunk = text[len(text) - len(unescaped(raw, start, end)):]
            opens = np.flatnonzero(IS_MARK[np.frombuffer(chunk, np.uint8)])[at[over]] + len(text) - len(chunk)
            for i, pos in zip((over + first).tolist(), opens.tolist()):
                if key := KEY_BEFORE.search(text, max(0, pos - 80), pos):
                    counts[key.group(1).decode("utf-8", "replace")] = int(items[i])
        first += at.size
    return deepest, counts


def chunks(raw: bytes) -> Iterator[tuple[int, int]]:
    """About CHUNK bytes at a time, each ending just after a byte that is no backslash: no escape spans two."""
    start = 0
    while start < len(raw):
        end = start + CHUNK
        if end < len(raw) and raw[end - 1] == BACKSLASH:
            found = NOT_BACKSLASH.search(raw, end)
            end = found.end() if found else len(raw)
        yield start, min(end, len(raw))
        start = end


def unescaped(raw: bytes, start: int, end: int) -> bytes:
    """raw[start:end] without its escaped backslashes and quotes: backslashes pair up left to right as JSON's
    escapes do, so with the pairs and then the escaped quotes gone, a byte is outside every string when an even
    number of quotes come before it."""
    part = raw[start:end]
    return part.replace(b"\\\\", b"").replace(b'\\"', b"") if BACKSLASH in part else part


def parse_body(raw: bytes, content_type: str | None, model: type[M], limits: BodyLimits) -> M:
    bounds = list_bounds(limits, model)
    data = read_json(raw, content_type, limits, bounds)
    check_counts(data, limits, bounds)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in err.errors()]) from None


def validation_error_body(err: RequestValidationError) -> dict[str, Any]:
    """OpenAI answers 400 and names the parameter; FastAPI's default is a 422 with a list."""
    first = err.errors()[0] if err.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        message, param = "the request body is not valid JSON", None
    else:
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid body")
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": "invalid_value"}}


def read_json(raw: bytes, content_type: str | None, limits: BodyLimits,
              bounds: dict[str, tuple[int, str]] | None = None) -> Any:
    kind = (content_type or "").split(";")[0].strip().lower()
    if not (kind == "application/json" or kind.startswith("application/") and kind.endswith("+json")):
        raise InvalidRequest("the request body must be JSON, sent with `Content-Type: application/json`")
    if not raw:
        raise InvalidRequest("the request body is empty; send a JSON object")
    bounds = list_bounds(limits) if bounds is None else bounds
    depth, counts = json_shape(raw, min(bound for bound, _ in bounds.values()))
    if depth > limits.max_depth:
        raise InvalidRequest(f"the request body nests arrays and objects {depth} levels deep; at most "
                             f"{limits.max_depth} are accepted (MAX_JSON_DEPTH)", code="json_too_deep")
    for field, count in counts.items():  # the bounds check_counts applies, before parsing lists too long to keep
        if (bound := bounds.get(field)) and count > bound[0]:
            raise too_many(field, count, *bound)
    try:  # decoded only now: a body refused above costs no 1 MiB string
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("the request body is not valid JSON: it must be UTF-8") from None
    try:
        return json.loads(text, parse_constant=no_constant, parse_float=finite_float)
    except NotFinite as err:
        raise InvalidRequest(f"the request body is not valid JSON: {err} is not a JSON number (NaN and infinities "
                             "are not allowed)", code="invalid_value") from None
    except (ValueError, RecursionError):  # JSONDecodeError, or an integer of more than 4,300 digits
        raise InvalidRequest("the request body is not valid JSON", code="invalid_value") from None


class NotFinite(ValueError):
    pass


def no_constant(name: str) -> float:
    raise NotFinite(name)


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 reads as inf
        raise NotFinite(text if len(text) <= 40 else text[:40] + "...")
    return value


def check_counts(data: Any, limits: BodyLimits, bounds: dict[str, tuple[int, str]] | None = None) -> None:
    """Bounds on what pydantic would otherwise validate item by item: messages (Responses' `input` items), the
    content blocks and tool calls inside them (Anthropic's `system` and `tool_result` blocks too), and tools."""
    if not isinstance(data, dict):
        return  # pydantic names what is wrong
    for field, bound in (list_bounds(limits) if bounds is None else bounds).items():
        if isinstance(items := data.get(field), list) and len(items) > bound[0]:
            raise too_many(field, len(items), *bound)
    blocks = len(system) if isinstance(system := data.get("system"), list) else 0
    for field in ("messages", "input"):
        items = data.get(field)
        if not isinstance(items, list):
            continue
        for i, item in enumerate(items):
            for key in ("content", "tool_calls") if isinstance(item, dict) else ():
                if isinstance(parts := item.get(key), list):
                    blocks += len(parts) + sum(len(p["content"]) for p in parts
                                               if isinstance(p, dict) and isinstance(p.get("content"), list))
                    if blocks > limits.max_content_blocks:
                        raise too_many(f"{field}.{i}.{key}", blocks, limits.max_content_blocks,
                                       "MAX_CONTENT_BLOCKS", what="content blocks and tool calls, counted to here")
    if blocks > limits.max_content_blocks:
        raise too_many("system", blocks, limits.max_content_blocks, "MAX_CONTENT_BLOCKS", what="content blocks")


def list_bounds(limits: BodyLimits, model: type | None = None) -> dict[str, tuple[int, str]]:
    """Each top-level list's bound and the setting that names it; a request model's own `LIST_BOUNDS` win."""
    return {"tools": (limits.max_tools, "MAX_TOOLS"), "messages": (limits.max_messages, "MAX_MESSAGES"),
            "input": (limits.max_messages, "MAX_MESSAGES"), **getattr(model, "LIST_BOUNDS", {})}


def too_many(param: str, count: int, limit: int, setting: str, what: str = "items") -> InvalidRequest:
    return InvalidRequest(f"`{param}` has {count:,} {what}; at most {limit:,} are accepted ({setting})",
                          param=param, code="too_many_items")
