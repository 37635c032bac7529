"""The streaming machine every marker-based format shares: content until a marker opens a tool section, the
section held back until its closing marker (or the end of the answer), then parsed once.

Each family's parser (llama3.py, mistral.py, deepseek.py, ...) says only what differs: the markers that open a
section (`OPENS`), the one that closes it (`close_for`; None: the section runs to the end of the answer), the
characters that, first in the answer, make the whole answer a section (`BARE_START`: Llama 3's bare `{`, a
pythonic `[`), and how a section's text becomes calls (`parse_section`). The rules are Hermes's (hermes.py): a
tail that could still grow into a marker is held back, so no marker nor its start reaches content; a section goes
out as calls only once it is complete and every call in it is valid, else its text is content (when no call came
before it); text between and after calls is dropped. A section's closing marker is found by a scan that keeps its
state between tokens (one outside JSON strings for formats whose bodies are JSON), so each character is looked at
once; `judge` lets a format decide early that a section is no call (harmony's non-tool channels), so that plain
text is not held to the end of the answer.
"""

from __future__ import annotations

from typing import Any

from app.openai.tools.base import TagOutsideStrings, ToolCallDelta, ToolCallParser

# A tool section `judge` has not decided on after this many characters is taken for text.
UNDECIDED_MAX = 256


class TagAnywhere:
    """Finds `tag` in text that arrives piece by piece, strings or not (XML bodies): keeps the last few characters
    so a tag split over pieces is found, and looks at each character a bounded number of times."""

    def __init__(self, tag: str):
        self.tag = tag
        self.tail = ""  # the last len(tag) - 1 characters fed

    def feed(self, text: str) -> int:
        joined = self.tail + text
        at = joined.find(self.tag)
        if at >= 0:
            return at + len(self.tag) - len(self.tail)
        self.tail = joined[-(len(self.tag) - 1):] if len(self.tag) > 1 else ""
        return -1


def tail_prefix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is the start of one of `markers`."""
    longest = max((len(m) for m in markers), default=1) - 1
    for k in range(min(len(text), longest), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


def earliest(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """The first of `markers` in `text`: (offset, marker), or (-1, "")."""
    best, found = -1, ""
    for marker in markers:
        at = text.find(marker)
        if at >= 0 and (best < 0 or at < best):
            best, found = at, marker
    return best, found


class SectionParser(ToolCallParser):
    OPENS: tuple[str, ...] = ()
    BARE_START = ""  # first non-blank characters of an answer that make all of it one section
    STRING_AWARE = True  # the closing marker is looked for outside JSON strings (bodies in JSON)

    def __init__(self, tool_names=(), parallel: bool = True, schemas: dict[str, Any] | None = None):
        super().__init__(tool_names, parallel, schemas)
        self.state = "start" if self.BARE_START else "text"  # start -> text | bare; text -> section -> between ...
        self.blank: list[str] = []  # "start": the leading whitespace
        self.pending = ""  # text not yet shown: a tail that could still become a marker
        self.section: list[str] = []  # the open section's text, its opening marker first
        self.marker = ""  # the marker that opened it
        self.end: TagOutsideStrings | TagAnywhere | None = None
        self.decided = False  # `judge` said the open section is a call
        self.done = False  # parallel_tool_calls=false and a call is out: the rest is ignored

    # ---- what a format says ----

    def close_for(self, marker: str) -> str | None:
        """The marker that ends a section opened by `marker`; None: it runs to the end of the answer."""
        return None

    def judge(self, text: str) -> bool | None:
        """Is the open section (its text so far) a call? None: cannot tell yet. Most formats' markers say so."""
        return True

    def parse_section(self, text: str) -> list[tuple[str, str]] | None:
        """A whole section (markers included) -> [(name, arguments JSON)], or None if it is not all valid calls."""
        raise NotImplementedError

    # ---- the machine ----

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        if self.done or not text:
            return []
        if self.state == "start":
            stripped = text.lstrip()
            if not stripped:
                self.blank.append(text)
                return []
            text, self.blank = "".join(self.blank) + text, []
            if stripped[0] in self.BARE_START:
                self.state, self.section = "bare", [text]
                return []
            self.state = "text"
        if self.state == "bare":
            self.section.append(text)
            return []
        self.pending += text
        return self._advance()

    def _advance(self) -> list[str | ToolCallDelta]:
        out: list[str | ToolCallDelta] = []
        while True:
            if self.state in ("text", "between"):
                at, marker = earliest(self.pending, self.OPENS)
                if at < 0:  # hold back a tail that could still grow into a marker
                    hold = tail_prefix_len(self.pending, self.OPENS)
                    cut = len(self.pending) - hold
                    if self.state == "text" and cut:
                        out.append(self.pending[:cut])
                    self.pending = self.pending[cut:]
                    return out
                if self.state == "text" and at:
                    out.append(self.pending[:at])
                close = self.close_for(marker)
                self.end = None if close is None else (TagOutsideStrings(close) if self.STRING_AWARE
                                                       else TagAnywhere(close))
                self.state, self.marker, self.section, self.decided = "section", marker, [marker], False
                self.pending = self.pending[at + len(marker):]
            else:  # "section": each new character goes to the closing-marker search once
                text, self.pending = self.pending, ""
                end = self.end.feed(text) if self.end is not None else -1
                self.section.append(text if end < 0 else text[:end])
                if not self.decided:
                    verdict = self.judge("".join(self.section))
                    if verdict is None and sum(map(len, self.section)) > UNDECIDED_MAX:
                        verdict = False
                    if verdict is False:  # no call: its marker is text, and the rest is looked at again
                        rest = "".join(self.section)[len(self.marker):] + (text[end:] if end >= 0 else "")
                        if self.calls == 0:
                            out.append(self.marker)
                        self.state, self.section, self.pending = ("between" if self.calls else "text"), [], rest
                        continue
                    self.decided = verdict is True
                if end < 0:
                    return out
                out += self._close_section()
                self.state, self.pending = ("between" if self.calls else "text"), text[end:]
                if not self.parallel and self.calls:
                    self.done = True
                    return out

    def _close_section(self) -> list[str | ToolCallDelta]:
        text, self.section = "".join(self.section), []
        calls = self.parse_section(text) if self.decided or self.judge(text) else None
        if calls:
            return self._whole_calls(calls)
        return [text] if self.calls == 0 else []  # not calls after all: the model's text, if nothing came before

    def finish(self) -> list[str | ToolCallDelta]:
        if self.done:
            return []
        if self.state == "start":
            rest, self.blank = "".join(self.blank), []
            return [rest] if rest else []
        if self.state in ("bare", "section"):
            return self._close_section()
        rest, self.pending = self.pending, ""
        return [rest] if self.state == "text" and rest else []
