"""gpt-oss's harmony tool calls: a message on the `commentary` channel addressed to `functions.NAME`:

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The recipient may also come before the channel (`<|start|>assistant to=functions.get_weather<|channel|>commentary
json<|message|>...`), and the first message of an answer starts at `<|channel|>`, its `<|start|>assistant` being
the prompt's. A section opens at `<|start|>` or `<|channel|>` and is judged when its header ends at `<|message|>`:
a call if the header addresses `functions.NAME` on the commentary channel, else it is no call and its text, channel
markers and all, stays content (the reasoning parser deals with harmony's analysis and final channels; this one
takes out only the calls it parses, markers included).
"""

from __future__ import annotations

import re

from app.openai.tools.base import named_call
from app.openai.tools.sections import SectionParser

START, CHANNEL, MESSAGE, CALL = "<|start|>", "<|channel|>", "<|message|>", "<|call|>"
HEADER = re.compile(
    r"(?:<\|start\|>assistant)?\s*(?:to=functions\.(?P<before>[^\s<]+)\s*)?<\|channel\|>commentary"
    r"(?:\s+to=functions\.(?P<after>[^\s<]+))?\s*(?:<\|constrain\|>\s*)?(?:json)?\s*")


def call_header(header: str) -> str | None:
    """The tool a message header addresses, or None if it is no tool call's header."""
    match = HEADER.fullmatch(header)
    if match is None or bool(match["before"]) == bool(match["after"]):
        return None
    return match["before"] or match["after"]


class HarmonyToolParser(SectionParser):
    OPENS = (START, CHANNEL)

    def close_for(self, marker: str) -> str | None:
        return CALL

    def judge(self, text: str) -> bool | None:
        header, sep, _ = text.partition(MESSAGE)
        return None if not sep else call_header(header) is not None

    def parse_section(self, text: str) -> list[tuple[str, str]] | None:
        header, _, body = text.partition(MESSAGE)
        name = call_header(header)
        call = named_call(name, body.removesuffix(CALL), self.tool_names) if name else None
        return [call] if call else None
