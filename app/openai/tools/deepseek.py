"""DeepSeek-V3 / R1 and DeepSeek-V3.1 tool calls, between the fullwidth-bar markers of their tokenizers:

  V3 / R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>
           ...<｜tool▁calls▁end｜>`
  V3.1:    `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`

One parser reads both: after the separator, a V3 call's name is followed by a newline and a ```json fence, a V3.1
call's arguments follow at once. Some R1 distills skip the outer marker; a lone `<｜tool▁call▁begin｜>` opens a
section too.
"""

from __future__ import annotations

from app.openai.tools.base import named_call
from app.openai.tools.sections import SectionParser

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def deepseek_call(inner: str, tool_names: frozenset[str]) -> tuple[str, str] | None:
    head, sep, rest = inner.partition(SEP)
    if not sep:
        return None
    if head.strip() == "function" and "\n" in rest:  # V3: the name, then the arguments in a ```json fence
        name, _, fenced = rest.partition("\n")
        fenced = fenced.strip()
        if not fenced.startswith("```"):
            return None
        arguments = fenced.removeprefix("```json").removeprefix("```").removesuffix("```")
        return named_call(name, arguments, tool_names)
    return named_call(head, rest, tool_names)


def deepseek_calls(text: str, tool_names: frozenset[str]) -> list[tuple[str, str]] | None:
    body = text.strip().removeprefix(CALLS_BEGIN).removesuffix(CALLS_END)
    parts = body.split(CALL_BEGIN)
    if parts[0].strip():
        return None  # text before the first call, inside the section
    calls = []
    for part in parts[1:]:
        inner, _, after = part.partition(CALL_END)
        call = deepseek_call(inner, tool_names)
        if call is None or after.strip():
            return None
        calls.append(call)
    return calls or None


class DeepSeekV3ToolParser(SectionParser):
    OPENS = (CALLS_BEGIN, CALL_BEGIN)

    def close_for(self, marker: str) -> str | None:
        return CALLS_END if marker == CALLS_BEGIN else CALL_END

    def parse_section(self, text: str) -> list[tuple[str, str]] | None:
        if not text.startswith(CALLS_BEGIN):
            text = CALLS_BEGIN + text
        return deepseek_calls(text, self.tool_names)
