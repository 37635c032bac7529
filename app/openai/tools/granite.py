"""IBM Granite's and Microsoft Phi-4-mini's tool calls, both a JSON list of {"name", "arguments"} after
`<|tool_call|>`:

  * granite (Granite 3.x): `<|tool_call|>[{...}, {...}]` to the end of the answer (Granite 3.1 on may spell the
    marker as the text `<tool_call>`, as vLLM's granite parser also reads);
  * phi4_mini: `<|tool_call|>[...]<|/tool_call|>`, and `functools[...]` as vLLM's phi4_mini_json parser reads it.

Both also read the list alone as the whole answer: their real tokenizers mark `<|tool_call|>` special, and decoding
skips special tokens (app/core/detokenize.py), so the list may arrive without it. Mistral's parser does the same for
its `[TOOL_CALLS]`.
"""

from __future__ import annotations

from app.openai.tools.base import json_list_calls
from app.openai.tools.sections import SectionParser

TOOL_CALL = "<|tool_call|>"
GRANITE_TEXT_MARKER = "<tool_call>"
PHI_CLOSE, FUNCTOOLS = "<|/tool_call|>", "functools"


class GraniteToolParser(SectionParser):
    OPENS = (TOOL_CALL, GRANITE_TEXT_MARKER)
    BARE_START = "["  # the list alone: the marker is a special token that decoding skipped

    def parse_section(self, text: str) -> list[tuple[str, str]] | None:
        body = text.strip().removeprefix(TOOL_CALL).removeprefix(GRANITE_TEXT_MARKER)
        return json_list_calls(body, self.tool_names)


class Phi4MiniToolParser(SectionParser):
    OPENS = (TOOL_CALL, FUNCTOOLS + "[")
    BARE_START = "["  # the list alone: the marker is a special token that decoding skipped

    def close_for(self, marker: str) -> str | None:
        return PHI_CLOSE if marker == TOOL_CALL else None

    def parse_section(self, text: str) -> list[tuple[str, str]] | None:
        body = text.strip()
        if body.startswith(FUNCTOOLS):
            return json_list_calls(body.removeprefix(FUNCTOOLS), self.tool_names)
        return json_list_calls(body.removeprefix(TOOL_CALL).removesuffix(PHI_CLOSE), self.tool_names)
