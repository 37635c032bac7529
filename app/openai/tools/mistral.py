"""Mistral's tool calls, both spellings, with the 9-character call ids Mistral's templates require.

  * `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3, Nemo, Small 3.0 / 3.1's older
    tokenizers): one JSON list after the marker;
  * `[TOOL_CALLS]get_weather[ARGS]{...}[TOOL_CALLS]f[ARGS]{...}` (tokenizer v11 on: Mistral Small 3.2, Magistral,
    Devstral), also with `[CALL_ID]id` before `[ARGS]` as some versions write it.

The section runs from the first `[TOOL_CALLS]` to the end of the answer. Mistral's chat templates raise unless a
tool call's id is exactly 9 letters or digits, and so does Mistral's API, so this parser's ids are such (vLLM's
Mistral parser does the same).
"""

from __future__ import annotations

import secrets

from app.openai.tools.base import ID_CHARS, json_list_calls, named_call
from app.openai.tools.sections import SectionParser

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def mistral_call_id() -> str:
    return "".join(secrets.choice(ID_CHARS) for _ in range(9))


def mistral_calls(text: str, tool_names: frozenset[str]) -> list[tuple[str, str]] | None:
    body = text.strip().removeprefix(TOOL_CALLS)
    if body.lstrip().startswith(("[", "{")):
        return json_list_calls(body, tool_names)
    calls = []
    for part in body.split(TOOL_CALLS):
        name, sep, arguments = part.partition(ARGS)
        if not sep:
            return None
        call = named_call(name.partition(CALL_ID)[0], arguments, tool_names)
        if call is None:
            return None
        calls.append(call)
    return calls or None


class MistralToolParser(SectionParser):
    OPENS = (TOOL_CALLS,)
    BARE_START = "["  # the list alone: the marker is a special token that decoding skipped

    def new_id(self) -> str:
        return mistral_call_id()

    def parse_section(self, text: str) -> list[tuple[str, str]] | None:
        return mistral_calls(text, self.tool_names)
