"""Anthropic's Messages API request (`POST /v1/messages`, `/v1/messages/count_tokens`), and the chat request it means.

As with the Responses API there is one path underneath: a Messages request is rewritten into the
`ChatCompletionRequest` it means, in `to_chat_request` and nowhere else, and from there the same template, sampling
parameters, grammar, engine and parsers serve it. The mapping:
  * `system` (a string or text blocks) -> a system message; `text` blocks -> the turn's content (joined by a blank
    line); `tool_use` blocks -> the assistant turn's `tool_calls` (their `input` object as the arguments);
    `tool_result` blocks -> `tool` messages, in order; `thinking` blocks -> the turn's `reasoning_content`;
  * `max_tokens` -> `max_completion_tokens`, `stop_sequences` -> `stop`; `temperature`, `top_p`, `top_k` as they
    are (today's SDK no longer sends these three; older clients and `extra_body` do);
  * `tools[].input_schema` -> `tools[].function.parameters`; `tool_choice` auto / any / tool / none -> "auto" /
    "required" / the named function / "none" (forced ones run under the grammar), `disable_parallel_tool_use` ->
    `parallel_tool_calls: false`;
  * `output_config.format` (structured outputs, a JSON schema) -> `response_format` json_schema, under the grammar;
  * `thinking` (only for a model that thinks): `enabled` -> `max_reasoning_tokens = budget_tokens`; `adaptive` ->
    thinking capped by `output_config.effort` if given; both also set the template switch `thinking: true` (Granite's,
    DeepSeek-V3.1's); `disabled` or absent -> `enable_thinking: false` (Claude
    does not think unless asked). `budget_tokens` may be below Anthropic's minimum of 1,024: small models think less.
    A model that does not think accepts `thinking` and ignores it (vLLM ignores it for every model): agents such as
    Claude Code send it by default, and a 400 would stop them.

  * `image` blocks of a user turn -> image parts of its message, in order with its text (`source` base64 -> a
    `data:` URL, `url` -> the URL as it is), each named by its client's path (`messages.0.content.1.source`).

What cannot be honoured gets a 400 that says why: images for a model that reads text only, images outside user
turns, documents, Anthropic's server-side tools (web search, code execution: nothing here runs them), `mcp_servers`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema

from app.core.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS
from app.errors import InvalidRequest
from app.openai.content_parts import ImageUrlPart, TextPart, image_part
from app.openai.protocol import ChatCompletionRequest

# Our own sampling extras a Messages request may carry too (vLLM accepts the same extras on every API).
PASS_THROUGH = ("seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos",
                "min_tokens", "cache_salt")
# Where a chat parameter came from, so that a 400 names the field the client actually sent.
CHAT_TO_MESSAGES_PARAM = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
                          "max_reasoning_tokens": "thinking.budget_tokens"}
MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # what Anthropic's `image` blocks may hold
_STOP = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
StopSequences = Annotated[list[str] | None, WithJsonSchema({"anyOf": [
    {"type": "array", "items": _STOP, "maxItems": MAX_STOP_STRINGS}, {"type": "null"}]})]


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, citations: accepted (the prefix cache is automatic)


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ImageBlock(_Block):
    type: Literal["image"]
    source: dict[str, Any] | None = None


class DocumentBlock(_Block):
    type: Literal["document"]
    source: dict[str, Any] | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[Annotated[TextBlock | ImageBlock | DocumentBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str = ""


ContentBlock = Annotated[TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
                         | RedactedThinkingBlock, Field(discriminator="type")]


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required for custom tools; server tools (type "web_search_...") lack it
    type: str | None = None  # "custom", or absent


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # `display`: thinking is always shown in full
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1)


class OutputFormat(BaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class _Conversation(BaseModel):
    """What a Messages request and a count_tokens request share: everything that makes the prompt."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's spelling of output_config.format

    def to_chat_request(self, reasons: bool) -> ChatCompletionRequest:
        """The chat completions request this one means. `reasons`: whether the served model thinks."""
        if (self.model_extra or {}).get("mcp_servers"):
            raise InvalidRequest("`mcp_servers` is not supported: this server connects to no MCP server; pass the "
                                 "tools in `tools`", param="mcp_servers")
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), **self._sampling()}
        if self.tools:
            body["tools"] = [chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body.update(chat_tool_choice(self.tool_choice))
        output = self.output_config or OutputConfig()
        if fmt := output.format or self.output_format:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
        if reasons:
            body.update(chat_thinking(self.thinking, output.effort))
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as err:  # a shape the chat API refuses: name the field this client sent
            first = err.errors()[0]
            where = [str(part) for part in first["loc"]]
            param = ".".join([CHAT_TO_MESSAGES_PARAM.get(where[0], where[0])] + where[1:]) if where else None
            raise InvalidRequest(f"{param}: {first['msg']}", param=param) from err

    def _sampling(self) -> dict[str, Any]:
        return {}

    @property
    def prefill(self) -> bool:
        """A last assistant turn is text for the model to continue (Anthropic's "prefill"), not a finished turn."""
        last = self.messages[-1]
        if last.role != "assistant" or any(isinstance(b, ToolUseBlock) for b in blocks(last.content)):
            return False
        return any(isinstance(b, TextBlock) and b.text for b in blocks(last.content))

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.system:
            # Claude Code's first system block is a billing header with a per-request hash: the model does not need
            # it, and it would put a different first line on every prompt, defeating the prefix cache (as in vLLM)
            texts = [self.system] if isinstance(self.system, str) else [
                b.text for b in self.system if not b.text.startswith("x-anthropic-billing-header")]
            messages.append({"role": "system", "content": "\n\n".join(texts)})
        for i, message in enumerate(self.messages):
            turn = user_turn if message.role == "user" else assistant_turn
            messages += turn(blocks(message.content), f"messages.{i}.content")
        return messages


class CountTokensRequest(_Conversation):
    pass


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: StopSequences = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None  # `user_id`: accepted, logged nowhere
    stream: bool = False

    def _sampling(self) -> dict[str, Any]:
        fields = {"max_completion_tokens": self.max_tokens, "stream": self.stream, "stop": self.stop_sequences,
                  "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        extra = self.model_extra or {}
        fields.update({name: extra[name] for name in PASS_THROUGH if name in extra})
        return {k: v for k, v in fields.items() if v is not None}


def blocks(content: str | list) -> list:
    return [TextBlock(type="text", text=content)] if isinstance(content, str) else content


def user_turn(content: list, where: str) -> list[dict[str, Any]]:
    """A user turn: its text and images as a user message, each tool result as a `tool` message, in the order
    given. Text blocks side by side are joined by a blank line; with images, the message's content is its parts."""
    out: list[dict[str, Any]] = []
    parts: list[TextPart | ImageUrlPart] = []

    def flush() -> None:
        if any(isinstance(part, ImageUrlPart) for part in parts):
            out.append({"role": "user", "content": list(parts)})
        elif parts:
            out.append({"role": "user", "content": parts[0].text})
        parts.clear()

    for j, block in enumerate(content):
        if isinstance(block, TextBlock):
            if parts and isinstance(parts[-1], TextPart):
                parts[-1] = TextPart(type="text", text=f"{parts[-1].text}\n\n{block.text}")
            else:
                parts.append(TextPart(type="text", text=block.text))
        elif isinstance(block, ImageBlock):
            parts.append(image_part(image_url(block, f"{where}.{j}.source"), f"{where}.{j}.source"))
        elif isinstance(block, ToolResultBlock):
            flush()
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": tool_result_text(block, f"{where}.{j}.content")})
        elif isinstance(block, DocumentBlock):
            raise text_only(block.type, f"{where}.{j}")
        else:
            raise InvalidRequest(f"a user message cannot hold a {block.type!r} block (it belongs to the assistant)",
                                 param=f"{where}.{j}.type")
    flush()
    return out or [{"role": "user", "content": ""}]


def assistant_turn(content: list, where: str) -> list[dict[str, Any]]:
    """An earlier answer: its text, its tool calls (input objects as JSON arguments), and its thinking."""
    texts, calls, thoughts = [], [], []
    for j, block in enumerate(content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": tool_input_json(block, f"{where}.{j}.input")}})
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, ImageBlock):
            raise InvalidRequest("only user turns may hold images", param=f"{where}.{j}.source")
        elif isinstance(block, DocumentBlock):
            raise text_only(block.type, f"{where}.{j}")
        elif isinstance(block, ToolResultBlock):
            raise InvalidRequest("a tool_result block belongs in a user message", param=f"{where}.{j}.type")
        # redacted_thinking: encrypted by Anthropic for Claude; nothing a local model can read
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "\n\n".join(thoughts)
    return [message]


def image_url(block: ImageBlock, where: str) -> str:
    """An `image` block's source as the URL a chat image part carries: base64 data as a `data:` URL."""
    source = block.source if isinstance(block.source, dict) else {}
    kind = source.get("type")
    if kind == "base64":
        if source.get("media_type") not in MEDIA_TYPES:
            raise InvalidRequest(f"{where}.media_type must be one of {', '.join(MEDIA_TYPES)}",
                                 param=f"{where}.media_type")
        if not isinstance(data := source.get("data"), str) or not data:
            raise InvalidRequest(f"{where}.data must be the image's bytes in base64", param=f"{where}.data")
        return f"data:{source['media_type']};base64,{data}"
    if kind == "url":
        if not isinstance(url := source.get("url"), str) or not url:
            raise InvalidRequest(f"{where}.url must be the image's URL", param=f"{where}.url")
        return url
    raise InvalidRequest(f"{where}.type must be \"base64\" or \"url\" (files are not served as images here)",
                         param=f"{where}.type")


def tool_input_json(block: ToolUseBlock, where: str) -> str:
    """A tool_use block's input as the JSON string a chat tool call carries."""
    try:  # strict JSON: a NaN would reach the template as a bare `NaN`
        return json.dumps(block.input, ensure_ascii=False, allow_nan=False)
    except RecursionError as err:  # deeper than the encoder's stack (about 1,000 levels of lists and objects)
        raise InvalidRequest("tool_use input is nested too deeply", param=where) from err
    except ValueError as err:
        raise InvalidRequest(f"tool_use input is not valid JSON: {err}", param=where) from err


def tool_result_text(block: ToolResultBlock, where: str) -> str:
    parts = blocks(block.content) if block.content is not None else []
    for j, part in enumerate(parts):
        if isinstance(part, ImageBlock):  # a chat `tool` message holds text alone
            raise InvalidRequest("images in a tool_result are not supported; send the image as an `image` block of "
                                 "the user turn", param=f"{where}.{j}")
        if not isinstance(part, TextBlock):
            raise text_only(part.type, f"{where}.{j}")
    text = "\n\n".join(part.text for part in parts)
    return f"Error: {text}" if block.is_error else text  # the template has no error flag: say it in words


def text_only(kind: str, where: str) -> InvalidRequest:
    return InvalidRequest(f"{kind} blocks are not supported: this server reads text and images only", param=where)


def chat_tool(tool: ToolDefinition, i: int) -> dict[str, Any]:
    if tool.input_schema is None or tool.type not in (None, "custom"):
        raise InvalidRequest(f"tool {tool.name!r} (type {tool.type!r}) is one of Anthropic's server tools, which "
                             "this server does not run; define a custom tool with an `input_schema`",
                             param=f"tools.{i}")
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def chat_tool_choice(choice: ToolChoice) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest('tool_choice {"type": "tool"} needs the tool\'s `name`', param="tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


def chat_thinking(thinking: ThinkingConfig | None, effort: str | None) -> dict[str, Any]:
    """For a model that thinks: Anthropic's `thinking` (and `output_config.effort`) as the chat request's reasoning
    switches. "xhigh" and "max" effort set no cap."""
    if thinking is None or thinking.type == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    # the switch of templates that think only when asked (Granite, DeepSeek-V3.1); others do not read it
    asked = {"chat_template_kwargs": {"thinking": True}}
    if thinking.type == "enabled" and thinking.budget_tokens is not None:
        return asked | {"max_reasoning_tokens": thinking.budget_tokens}
    return asked | ({"reasoning_effort": effort} if effort in ("low", "medium", "high") else {})
