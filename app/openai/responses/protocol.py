"""The Responses API request (`POST /v1/responses`), and how it becomes a chat completions request.

There is one path underneath: a Responses request is rewritten into the `ChatCompletionRequest` it means (input
items -> messages, flat tools -> chat tools, `text.format` -> `response_format`, `max_output_tokens` ->
`max_completion_tokens`, `reasoning.effort` -> `reasoning_effort`), and from there the same template, sampling
parameters, engine and parsers serve it. Only the wire shape of the answer differs (app/openai/responses/serving.py).

The server keeps no state, as Ollama's and vLLM's default: `store: true`, `previous_response_id`, `conversation`
and `background` get a 400 that says so, rather than an answer that silently forgot the conversation.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.errors import InvalidRequest
from app.openai.protocol import ChatCompletionRequest
from app.openai.responses.items import input_messages

# Responses fields that pass straight through to the chat request (vLLM accepts the same extras on both APIs).
PASS_THROUGH = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "seed", "stop", "chat_template_kwargs", "max_reasoning_tokens", "ignore_eos",
                "min_tokens", "logit_bias", "user", "cache_salt", "priority")
# Where a chat parameter came from, so that a 400 names the field the client actually sent.
CHAT_TO_RESPONSES_PARAM = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                           "messages": "input", "reasoning_effort": "reasoning.effort",
                           "response_format": "text.format"}


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON under a schema (its fields flat, unlike chat's)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # verbosity: accepted, as the model decides its own length
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    input: str | list[Any]  # items: validated one by one (items.py), so a 400 names the field
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None

    def check_stateless(self) -> None:
        extra = self.model_extra or {}
        stateful = [("previous_response_id", self.previous_response_id), ("conversation", extra.get("conversation")),
                    ("background", extra.get("background")), ("prompt", extra.get("prompt"))]
        for name, value in stateful:
            if value:
                raise InvalidRequest(f"`{name}` is not supported: this server keeps no responses between requests; "
                                     "send the whole conversation in `input`", param=name)
        if self.store:
            raise InvalidRequest("`store: true` is not supported: this server keeps no responses; send "
                                 "`store: false` (or leave it out) and the whole conversation in `input`",
                                 param="store")

    def to_chat_request(self) -> ChatCompletionRequest:
        """The chat completions request this Responses request means."""
        self.check_stateless()
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), "stream": self.stream}
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        extra = self.model_extra or {}
        for name in PASS_THROUGH:
            value = getattr(self, name, None) if name in type(self).model_fields else extra.get(name)
            if value is not None:
                body[name] = value
        if self.tools:
            body["tools"] = [chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.text and self.text.format is not None:
            body["response_format"] = chat_response_format(self.text.format)
        if self.reasoning and self.reasoning.get("effort") is not None:
            body["reasoning_effort"] = self.reasoning["effort"]
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as err:  # a shape the chat API refuses: name the Responses field it came from
            first = err.errors()[0]
            where = [str(part) for part in first["loc"]]
            param = ".".join([CHAT_TO_RESPONSES_PARAM.get(where[0], where[0])] + where[1:]) if where else None
            raise InvalidRequest(f"{param}: {first['msg']}", param=param) from err

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        if not self.input:
            raise InvalidRequest("`input` is empty", param="input")
        return messages + input_messages(self.input)


def chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """Responses' flat function tool -> the chat API's nested one."""
    if tool.get("type") != "function":
        raise InvalidRequest(f"tools of type {tool.get('type')!r} are not supported; function tools are",
                             param=f"tools.{i}.type")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                         param="tool_choice")


def chat_response_format(fmt: TextFormat) -> dict[str, Any]:
    """`text.format` -> `response_format`: json_schema's fields sit flat in the Responses API."""
    if fmt.type in ("text", "json_object"):
        return {"type": fmt.type}
    return {"type": "json_schema", "json_schema": fmt.model_dump(include={"name", "schema_", "strict", "description"},
                                                                 by_alias=True, exclude_none=True)}
