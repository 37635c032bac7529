"""The Responses API request (`POST /v1/responses`), and how it becomes a chat completions request.

There is one path underneath: a Responses request is rewritten into the `ChatCompletionRequest` it means (input
items -> messages, flat tools -> chat tools, `text.format` -> `response_format`, `max_output_tokens` ->
`max_completion_tokens`, `reasoning.effort` -> `reasoning_effort`), and from there the same template, sampling
parameters, engine and parsers serve it. Only the wire shape of the answer differs (app/openai/responses.py).

The server keeps no state, as Ollama's and vLLM's default: `store: true`, `previous_response_id`, `conversation`
and `background` get a 400 that says so, rather than an answer that silently forgot the conversation.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from app.errors import InvalidRequest
from app.openai.protocol import ChatCompletionRequest

# Responses fields that pass straight through to the chat request (vLLM accepts the same extras on both APIs).
PASS_THROUGH = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "seed", "stop", "chat_template_kwargs", "max_reasoning_tokens", "ignore_eos",
                "min_tokens", "logit_bias", "user", "cache_salt")
# Where a chat parameter came from, so that a 400 names the field the client actually sent.
CHAT_TO_RESPONSES_PARAM = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                           "messages": "input", "reasoning_effort": "reasoning.effort",
                           "response_format": "text.format"}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    text: dict[str, Any] | None = None
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
        if self.text and self.text.get("format") is not None:
            body["response_format"] = chat_response_format(self.text["format"])
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
        thought: str | None = None  # a reasoning item's text waits for the assistant turn it belongs to
        for i, item in enumerate(self.input):
            kind = item.get("type", "message" if "role" in item else None)
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise InvalidRequest(f"unknown role {role!r}", param=f"input.{i}.role")
                message = {"role": role, "content": item_text(item.get("content"), f"input.{i}.content")}
                if role == "assistant" and thought:
                    message["reasoning_content"], thought = thought, None
                messages.append(message)
            elif kind == "function_call":
                call = {"id": required(item, "call_id", i), "type": "function",
                        "function": {"name": required(item, "name", i), "arguments": item.get("arguments") or "{}"}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":  # calls of one turn share one message
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                    if thought:
                        messages[-1]["reasoning_content"], thought = thought, None
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": required(item, "call_id", i),
                                 "content": item_text(item.get("output"), f"input.{i}.output")})
            elif kind == "reasoning":
                parts = item.get("content") or item.get("summary") or []
                thought = "".join(p.get("text", "") for p in parts if isinstance(p, dict)) or None
            elif kind == "item_reference":
                raise InvalidRequest("`item_reference` needs stored responses, which this server does not keep",
                                     param=f"input.{i}")
            else:
                raise InvalidRequest(f"input items of type {kind!r} are not supported (message, function_call, "
                                     "function_call_output and reasoning are)", param=f"input.{i}.type")
        return messages


def required(item: dict[str, Any], name: str, i: int) -> Any:
    if not item.get(name):
        raise InvalidRequest(f"`{name}` is required", param=f"input.{i}.{name}")
    return item[name]


def item_text(content: Any, param: str) -> str:
    """A message's content: a string, or text parts (input_text, or output_text in earlier answers)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of text parts", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise InvalidRequest(f"content parts of type {kind!r} are not supported: this model reads text only",
                                 param=f"{param}.{j}.type")
        texts.append(part.get("text") or "")
    return "".join(texts)


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


def chat_response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """`text.format` -> `response_format`: json_schema's fields sit flat in the Responses API."""
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if fmt.get(k) is not None}}
    raise InvalidRequest(f"text.format type {kind!r} is not supported", param="text.format.type")
