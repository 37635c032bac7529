"""gpt-oss's harmony format: the thinking is the `analysis` channel, the answer the `final` channel.

The generation prompt ends with `<|start|>assistant`, and the model writes messages, each a header, `<|message|>`,
a body and an end marker:
    <|channel|>analysis<|message|>…thinking…<|end|><|start|>assistant<|channel|>final<|message|>…<|return|>
Every marker is a special token, dropped by decoding, so the splitter puts them back from the token ids.
`reasoning_effort` (low / medium / high) is the template's own switch ("Reasoning: low" in its system message), so it
sets no token budget here; `max_reasoning_tokens` still does (the engine then writes
`<|end|><|start|>assistant<|channel|>final<|message|>` itself).

The contract with the harmony tool-call parser, which reads this splitter's content:
- an `analysis` message without a recipient is reasoning; its header and end marker show nowhere;
- a `final` message without a recipient is content; its header (`<|start|>assistant<|channel|>final<|message|>`)
  and its end (`<|end|>`, `<|return|>`) are stripped;
- every other message (the `commentary` channel, and any message with a recipient ` to=…`, such as
  `<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{…}<|call|>`)
  passes on as content verbatim, from its `<|start|>` (when the model wrote one) through its end marker, markers
  included, for the tool-call parser to take apart;
- an answer that does not start like a harmony header is not harmony: all of it is content, as written.
As vLLM's openai_gptoss parser: an answer cut off inside the analysis channel is all reasoning. Picked when the
template writes `<|channel|>` and it is a token.
"""

from __future__ import annotations

import re

from app.openai.reasoning.base import (ReasoningFormat, ReasoningSplitter, budget_ids, first_marker, has_token,
                                       partial_marker, special_markers)

NAME = "harmony"
START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
CALL, RETURN, CONSTRAIN = "<|call|>", "<|return|>", "<|constrain|>"
MARKERS = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)
HEADER_STARTS = (START, CHANNEL, " to=", END)  # END: a budget forced at once writes <|end|> before any header
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([\w-]+)")


def detect(tokenizer, template: str) -> bool:
    return CHANNEL in template and has_token(tokenizer, CHANNEL)


def build(tokenizer) -> ReasoningFormat:
    end_ids, forced_ids = budget_ids(tokenizer, CHANNEL + "final" + MESSAGE, before=END + START + "assistant")
    return ReasoningFormat(NAME, end_ids, forced_ids, HarmonySplitter, markers=special_markers(tokenizer, MARKERS),
                           effort_in_template=True)


class HarmonySplitter(ReasoningSplitter):
    def __init__(self, thinking: bool = True, markers: dict[int, str] | None = None):
        super().__init__(markers)
        # "header": reading a message's header; "analysis" / "final" / "verbatim": in a message's body;
        # "plain": not harmony at all
        self.part = "header"
        self.pending = ""

    @property
    def state(self) -> str:  # the answer proper has begun once a message other than analysis does
        return "start" if self.part == "header" else "reasoning" if self.part == "analysis" else "content"

    def split(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning, content = [], []
        while self.pending:
            if self.part == "plain":
                content.append(self.pending)
                self.pending = ""
            elif self.part == "header":
                if not self._read_header(content):
                    break
            elif not self._read_body(reasoning if self.part == "analysis" else content):
                break
        return "".join(reasoning), "".join(content)

    def _read_header(self, content: list[str]) -> bool:
        """Consume one header, if it has all come; False: wait for more."""
        if self.pending.startswith(END):  # the end of a message the budget closed before it had begun
            self.pending = self.pending[len(END):]
            return True
        if not any(self.pending.startswith(m) or m.startswith(self.pending) for m in HEADER_STARTS):
            self.part = "plain"
            return True
        header, found, body = self.pending.partition(MESSAGE)
        if not found:
            return False
        channel = CHANNEL_NAME.search(header)
        name = channel.group(1) if channel else ""
        if " to=" in header or name not in ("analysis", "final"):
            self.part = "verbatim"
            content.append(header + MESSAGE)
        else:
            self.part = name
        self.pending = body
        return True

    def _read_body(self, out: list[str]) -> bool:
        """Consume a body up to its end marker, or as much as cannot be the start of one; False: wait for more."""
        found = first_marker(self.pending, (END, CALL, RETURN, START))
        if found is None:
            keep = partial_marker(self.pending, (END, CALL, RETURN, START))
            out.append(self.pending[: len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
            return False
        where, marker = found
        out.append(self.pending[:where])
        if marker == START:  # a new message without an end marker before it: its header is read next
            self.pending = self.pending[where:]
        else:
            if self.part == "verbatim":
                out.append(marker)
            self.pending = self.pending[where + len(marker):]
        self.part = "header"
        return True

    def flush(self) -> tuple[str, str]:
        """The answer ended: held text is real text, except an unfinished header or marker."""
        rest, self.pending = self.pending, ""
        if self.part == "analysis":
            return rest, ""
        if self.part in ("final", "verbatim", "plain"):
            return "", rest
        return "", ""  # a header cut off before <|message|> says nothing yet
