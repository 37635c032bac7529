"""Request bodies: JSON parsed, bounded and validated on a prepare worker (app/prepare.py), never on the event loop.

The checks run cheapest first, so a hostile body is refused before it costs much:
1. UTF-8 and a JSON content type (a form post from a web page is no JSON: no simple-request CSRF);
2. nesting depth (`MAX_JSON_DEPTH`) and the length of the top-level lists (`MAX_MESSAGES`, `MAX_TOOLS`), from the
   raw bytes (`json_shape`): a few linear numpy passes, ~10 ms for 1 MiB where json.loads takes ~26 ms of GIL
   on 31,000 small messages; a bomb of 500,000 `[` never reaches the recursive parser;
3. `json.loads`, refusing NaN, Infinity and numbers too large for a float: JSON has none of them, and a NaN that
   got in was echoed back as bare `NaN`, which strict parsers reject;
4. item counts (`MAX_MESSAGES`, `MAX_CONTENT_BLOCKS`, `MAX_TOOLS`) on the parsed dict, before pydantic: validating
   31,000 messages cost ~100 ms of GIL per body;
5. pydantic, whose errors become the same 400 as FastAPI's own validation errors (app/main.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from app.errors import InvalidRequest

M = TypeVar("M", bound=BaseModel)
QUOTE, COMMA = 34, 44
STEP = np.zeros(256, np.int32)  # what a byte outside strings does to the nesting depth
STEP[list(b"[{")], STEP[list(b"]}")] = 1, -1
TRACKED = (STEP != 0) | (np.arange(256) == COMMA)
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
    that mean nothing). A few passes of numpy over the body, ~3 ms for 1 MiB: json.loads took ~40 ms of GIL
    on a body of 31,000 small messages, and the recursive parser meets the nesting only once it is built."""
    # Backslashes pair up left to right as JSON's escapes do: with the pairs and then the escaped quotes gone,
    # a byte is outside every string when an even number of quotes come before it.
    plain = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    text = np.frombuffer(plain, np.uint8)
    where = np.flatnonzero(TRACKED[text])
    where = where[(np.cumsum(text == QUOTE, dtype=np.uint8)[where] & 1) == 0]  # parity survives uint8 wrap-around
    if where.size == 0:
        return 0, {}
    steps = STEP[text[where]]
    depth = np.cumsum(steps)  # after each bracket or comma
    # top-level values that are arrays or objects open at depth 2; their items are separated by commas at depth 2
    opens = np.flatnonzero((steps == 1) & (depth == 2))
    owner = np.cumsum((steps == 1) & (depth == 2)) - 1
    items = np.bincount(owner[(steps == 0) & (depth == 2)], minlength=opens.size) + 1
    counts = {}
    for i in np.flatnonzero(items > at_least):
        start = int(where[opens[i]])
        if key := KEY_BEFORE.search(plain, max(0, start - 80), start):
            counts[key.group(1).decode("utf-8", "replace")] = int(items[i])
    return int(depth.max()), counts


def parse_body(raw: bytes, content_type: str | None, model: type[M], limits: BodyLimits) -> M:
    data = read_json(raw, content_type, limits)
    check_counts(data, limits)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in err.errors()]) from None


def read_json(raw: bytes, content_type: str | None, limits: BodyLimits) -> Any:
    kind = (content_type or "").split(";")[0].strip().lower()
    if not (kind == "application/json" or kind.startswith("application/") and kind.endswith("+json")):
        raise InvalidRequest("the request body must be JSON, sent with `Content-Type: application/json`")
    if not raw:
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("the request body is not valid JSON: it must be UTF-8") from None
    depth, counts = json_shape(raw, min(limits.max_messages, limits.max_tools))
    if depth > limits.max_depth:
        raise InvalidRequest(f"the request body nests arrays and objects {depth} levels deep; at most "
                             f"{limits.max_depth} are accepted (MAX_JSON_DEPTH)", code="json_too_deep")
    for field, count in counts.items():  # the bounds check_counts applies, before parsing lists too long to keep
        if (bound := list_bounds(limits).get(field)) and count > bound[0]:
            raise too_many(field, count, *bound)
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


def check_counts(data: Any, limits: BodyLimits) -> None:
    """Bounds on what pydantic would otherwise validate item by item: messages (Responses' `input` items), the
    content blocks and tool calls inside them (Anthropic's `system` and `tool_result` blocks too), and tools."""
    if not isinstance(data, dict):
        return  # pydantic names what is wrong
    for field, bound in list_bounds(limits).items():
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


def list_bounds(limits: BodyLimits) -> dict[str, tuple[int, str]]:
    return {"tools": (limits.max_tools, "MAX_TOOLS"), "messages": (limits.max_messages, "MAX_MESSAGES"),
            "input": (limits.max_messages, "MAX_MESSAGES")}


def too_many(param: str, count: int, limit: int, setting: str, what: str = "items") -> InvalidRequest:
    return InvalidRequest(f"`{param}` has {count:,} {what}; at most {limit:,} are accepted ({setting})",
                          param=param, code="too_many_items")
