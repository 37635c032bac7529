"""The splitter of formats that wrap the thinking in an open and a close marker, at the start of the answer.

Four families write their thinking this way and differ only in the markers and in who opens them:
- opened by the template (DeepSeek-R1, QwQ, Qwen3): the answer starts inside the thinking; a generated open tag is
  dropped; the text up to the close tag is reasoning, and if the close tag never comes (max_tokens cut the thinking
  short) all of it is reasoning;
- opened by the model (Magistral's `[THINK]`, Granite's "Here is my thought process:"): the answer is reasoning only
  if it starts with the open marker; otherwise it is all content.
Either way the text after the close marker is content, and the whitespace around the thinking
(`<think>\\n…\\n</think>\\n\\n`) shows in neither, as llama.cpp trims it. A close marker right at the start is an
empty thinking (the engine forced it at once: a budget of 0).
"""

from __future__ import annotations

from app.openai.reasoning.base import ReasoningSplitter, first_marker, partial_marker


class TaggedSplitter(ReasoningSplitter):
    def __init__(self, opens: tuple[str, ...], closes: tuple[str, ...], opened_by_template: bool, thinking: bool,
                 markers: dict[int, str] | None = None):
        super().__init__(markers)
        self.opens, self.closes, self.opened_by_template = opens, closes, opened_by_template
        # "start": before the thinking (an open marker may come); "reasoning"; "content"
        self.state = "start" if thinking else "content"
        self.trim_content = False  # drop the whitespace between the close marker and the answer
        self.reasoning_shown = False  # leading whitespace of the thinking is dropped
        self.pending = ""  # held back: a possible marker start, or whitespace that may turn out to be trailing

    def split(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning = content = ""
        if self.state == "start" and not self._leave_start():
            return "", ""
        if self.state == "reasoning":
            found = first_marker(self.pending, self.closes)
            if found:
                where, close = found
                reasoning = self._reasoning(self.pending[:where].rstrip())
                self.pending, self.state, self.trim_content = self.pending[where + len(close):], "content", True
            else:
                keep = self._tail_to_hold(self.pending)
                reasoning = self._reasoning(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
        if self.state == "content":
            if self.trim_content:
                self.pending = self.pending.lstrip()
                self.trim_content = not self.pending
            content, self.pending = self.pending, ""
        return reasoning, content

    def _leave_start(self) -> bool:
        """Decide, once enough has come, whether the answer opens with thinking; False: wait for more."""
        head = self.pending.lstrip()
        if any(m.startswith(head) for m in self.opens + self.closes):  # nothing yet, or a marker's start
            return False
        opened = next((m for m in self.opens if head.startswith(m)), None)
        closed = next((m for m in self.closes if head.startswith(m)), None)
        if closed is not None:  # an empty thinking
            self.pending, self.state, self.trim_content = head[len(closed):], "content", True
        elif opened is not None:
            self.pending, self.state = head[len(opened):], "reasoning"
        elif self.opened_by_template:
            self.pending, self.state = head, "reasoning"
        else:
            self.state = "content"  # the model did not think: its answer as it wrote it
        return True

    def flush(self) -> tuple[str, str]:
        """The answer ended: what is held is real text, except a thinking's trailing whitespace."""
        rest, self.pending = self.pending, ""
        if self.state == "content":
            return "", rest
        if self.state == "start":  # only whitespace or a marker's start came: nothing worth showing
            head = rest.strip()
            if any(m.startswith(head) for m in self.opens + self.closes):
                return "", ""
            return (self._reasoning(head), "") if self.opened_by_template else ("", rest)
        return self._reasoning(rest.rstrip()), ""

    def _reasoning(self, text: str) -> str:
        if not self.reasoning_shown:
            text = text.lstrip()
            self.reasoning_shown = bool(text)
        return text

    def _tail_to_hold(self, text: str) -> int:
        """How much of the end of `text` might still be whitespace before a close marker, or the marker's start."""
        k = partial_marker(text, self.closes)
        body = text[: len(text) - k]
        return k + len(body) - len(body.rstrip())
