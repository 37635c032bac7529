"""Request bodies: JSON parsed, bounded and validated on a prepare worker (app/prepare.py), never on the event loop.

The checks run cheapest first, so a hostile body is refused before it costs much:
1. UTF-8 and a JSON content type (a form post from a web page is no JSON: no simple-request CSRF);
2. nesting depth (`MAX_JSON_DEPTH`), from the raw bytes: strings cut out with `split`, every byte but brackets
   dropped, then a running sum in numpy. Linear, C all the way, and no slower than `json.loads` itself on the
   same body; so a bomb of 500,000 `[` never reaches the recursive parser (nor, later, recursive template code);
3. `json.loads`, refusing NaN, Infinity and numbers too large for a float: JSON has none of them, and a NaN that
   got in was echoed back as bare `NaN`, which strict parsers reject;
4. item counts (`MAX_MESSAGES`, `MAX_CONTENT_BLOCKS`, `MAX_TOOLS`) on the parsed dict, before pydantic: validating
   31,000 messages cost ~100 ms of GIL per body;
5. pydantic, whose errors become the same 400 as FastAPI's own validation errors (app/main.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from app.errors import InvalidRequest

M = TypeVar("M", bound=BaseModel)
NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
STEP = np.zeros(256, np.int32)
STEP[list(b"[{")], STEP[list(b"]}")] = 1, -1


@dataclass(frozen=True)
class BodyLimits:
    max_depth: int = 128
    max_messages: int = 2048
    max_content_blocks: int = 8192
    max_tools: int = 128


def nesting_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in this JSON text (for text that is not JSON: some number >= 0)."""
    # Backslashes pair up left to right as JSON's escapes do: with the pairs and then the escaped quotes gone,
    # every quote left opens or closes a string, and the even pieces between them are outside strings.
    plain = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(plain.split(b'"')[::2]).translate(None, NOT_BRACKETS)
    if not brackets:
        return 0
    return int(np.cumsum(STEP[np.frombuffer(brackets, np.uint8)]).max())


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
    if (depth := nesting_depth(raw)) > limits.max_depth:
        raise InvalidRequest(f"the request body nests arrays and objects {depth} levels deep; at most "
                             f"{limits.max_depth} are accepted (MAX_JSON_DEPTH)", code="json_too_deep")
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
    if isinstance(tools := data.get("tools"), list) and len(tools) > limits.max_tools:
        raise too_many("tools", len(tools), limits.max_tools, "MAX_TOOLS")
    blocks = len(system) if isinstance(system := data.get("system"), list) else 0
    for field in ("messages", "input"):
        items = data.get(field)
        if not isinstance(items, list):
            continue
        if len(items) > limits.max_messages:
            raise too_many(field, len(items), limits.max_messages, "MAX_MESSAGES")
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


def too_many(param: str, count: int, limit: int, setting: str, what: str = "items") -> InvalidRequest:
    return InvalidRequest(f"`{param}` has {count:,} {what}; at most {limit:,} are accepted ({setting})",
                          param=param, code="too_many_items")
