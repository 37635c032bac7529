"""One choice's answer as it grows: token events in, what the client sees out.

Every token event goes through the same steps, whichever wire format serves it (chat completions or the Responses
API): the reasoning splitter takes a thinking model's thinking out (app/openai/reasoning/), the tool-call parser
takes calls out of what remains (app/openai/tools/), and what is left is content. `Choice.add` returns that step's
`Delta`; the choice keeps the whole answer for a non-streamed response.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.core.sequence import NO_TOKEN, TokenEvent
from app.core.engine.handle import RequestHandle
from app.core.sampling import Inspection
from app.openai.reasoning import ReasoningSplitter
from app.openai.tools import ToolCallDelta, ToolCallParser


@dataclass
class Delta:
    """What one token event adds to a choice, as the client sees it: thinking first, then the answer."""

    reasoning: str = ""
    content: str = ""
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    inspect: dict[str, Any] | None = None  # the token inspector's stages, when asked for
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # after the content, when tools are parsed

    @property
    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.logprobs or self.finish_reason or self.inspect
                    or self.tool_calls)


@dataclass
class Choice:
    """What one choice has produced so far. `splitter` is set for a reasoning model's chat answers."""

    index: int
    handle: RequestHandle
    splitter: ReasoningSplitter | None = None
    text: list[str] = field(default_factory=list)  # the answer (content)
    reasoning: list[str] = field(default_factory=list)
    tokens: int = 0
    reasoning_tokens: int = 0  # tokens generated before the answer began (the thinking and its tags)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    inspect: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended the answer, if one did
    parser: ToolCallParser | None = None  # set when the answer is searched for tool calls
    tool_markers: dict[int, str] = field(default_factory=dict)  # with a parser: its markers decoding drops, by id
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # by index, as parsed so far
    prompt_logprobs: list | None = None  # the prompt's scores (app.core.sequence.PromptLogprob), when asked for

    def message(self) -> dict[str, Any]:
        """The chat `message`: a reasoning model's answer also carries its thinking, under both names; with tools,
        the calls, and content only if there is some."""
        content = "".join(self.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.parser is not None:
            message["content"] = content if content.strip() else None
            if self.tool_calls:
                message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        if self.splitter is None:
            return message
        reasoning = "".join(self.reasoning) or None
        return {**message, "content": message["content"] or None, "reasoning_content": reasoning,
                "reasoning": reasoning}

    def parse_tools(self, content: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        """Content deltas through the tool-call parser: (what stays content, call deltas)."""
        items = self.parser.feed(content) if content else []
        if finished:
            items += self.parser.finish()
        calls = [i for i in items if isinstance(i, ToolCallDelta)]
        for d in calls:
            if d.id is not None:
                self.tool_calls[d.index] = {"id": d.id, "type": "function",
                                            "function": {"name": d.name, "arguments": d.arguments}}
            else:
                self.tool_calls[d.index]["function"]["arguments"] += d.arguments
        return "".join(i for i in items if isinstance(i, str)), calls

    def add(self, event: TokenEvent, tokenizer) -> Delta:
        """Record one token event in its choice; return what it shows the client."""
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        is_token = event.token_id != NO_TOKEN  # a deadline's last event carries no token
        self.tokens += is_token
        text = event.text
        marker = self.tool_markers.get(event.token_id)
        if marker is not None and (self.splitter is None or event.token_id not in self.splitter.markers):
            text = marker + text  # a tool-call marker decoding dropped (app/openai/tools MARKERS)
        reasoning, content = "", text
        if self.splitter is not None:
            self.reasoning_tokens += is_token and self.splitter.state != "content"
            reasoning, content = self.splitter.feed(text, event.token_id)
            if event.finish_reason is not None:
                more_reasoning, more_content = self.splitter.flush()
                reasoning, content = reasoning + more_reasoning, content + more_content
        calls: list[ToolCallDelta] = []
        finish_reason = event.finish_reason
        if self.parser is not None:
            content, calls = self.parse_tools(content, finished=finish_reason is not None)
            if self.tool_calls and finish_reason == "stop":  # max_tokens cutting a call stays "length"
                finish_reason = "tool_calls"
        self.reasoning.append(reasoning)
        self.text.append(content)
        logprobs = None
        if event.logprob is not None:
            logprobs = event_logprobs(tokenizer, event)
            self.logprobs.append(logprobs)
        inspect = None
        if event.inspection is not None:
            inspect = inspect_entry(tokenizer, event.inspection)
            self.inspect.append(inspect)
        self.finish_reason = finish_reason or self.finish_reason
        self.stop_string = event.stop_string or self.stop_string
        return Delta(reasoning, content, logprobs, finish_reason, inspect, calls)


def token_entry(tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def event_logprobs(tokenizer, event: TokenEvent) -> dict[str, Any]:
    entry = token_entry(tokenizer, event.token_id, event.logprob)
    entry["top_logprobs"] = [token_entry(tokenizer, t, lp) for t, lp in (event.top_logprobs or [])]
    return entry


def inspect_entry(tokenizer, inspection: Inspection) -> dict[str, Any]:
    """The token inspector's wire shape: `probs[i]` is the candidate's probability after `stages[i]`."""
    return {"token": {"id": inspection.chosen, "text": tokenizer.decode([inspection.chosen])},
            "stages": inspection.stages,
            "candidates": [{"id": t, "text": tokenizer.decode([t]), "probs": [round(p, 6) for p in probs]}
                           for t, probs in zip(inspection.token_ids, inspection.probs)]}


def choice_calls(choice: Choice) -> list[ToolCallDelta]:
    """A whole answer's tool calls, as one delta each (id, name and all the arguments)."""
    return [ToolCallDelta(i, call["function"]["arguments"], call["id"], call["function"]["name"])
            for i, call in sorted(choice.tool_calls.items())]
