"""The wire shapes of tools, tool turns and response formats, and how tool turns are shown to a chat template."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.errors import InvalidRequest


class FunctionCall(BaseModel):
    name: str
    arguments: str = "{}"  # a JSON string on the wire


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def template_tool_calls(calls: list[ToolCall], where: str) -> list[dict[str, Any]]:
    """An assistant turn's calls as templates expect them. Arguments arrive as a JSON string, but templates want a
    dict (Qwen's applies `tojson`, which would encode a string twice), so they are decoded here, as vLLM does."""
    out = []
    for j, call in enumerate(calls):
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except (ValueError, RecursionError) as err:  # nesting deeper than the decoder's stack: RecursionError
            raise InvalidRequest(f"tool call arguments are not valid JSON: {err}",
                                 param=f"{where}.tool_calls.{j}.function.arguments") from err
        out.append({"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}})
    return out


class ToolFields(BaseModel):
    """The chat request's tool and response-format fields, and what they ask for together."""

    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    def check_tools(self) -> None:
        """What the tool fields ask must make sense together (OpenAI's and vLLM's 400s)."""
        if self.tools is not None and not self.tools:
            raise InvalidRequest("`tools` is empty; leave it out or offer at least one tool", param="tools")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise InvalidRequest("tool names must be unique", param="tools")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise InvalidRequest("`tool_choice` needs `tools`", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise InvalidRequest(f"tool_choice names {self.tool_choice.function.name!r}, which is not in `tools`",
                                 param="tool_choice")
        if self.forced_tools and self.json_format:
            raise InvalidRequest("`response_format` cannot be combined with a forced `tool_choice`",
                                 param="response_format")
        if self.response_format is not None and self.response_format.type == "json_schema" and (
                self.response_format.json_schema is None or self.response_format.json_schema.schema_ is None):
            raise InvalidRequest('response_format {"type": "json_schema"} needs `json_schema.schema`',
                                 param="response_format.json_schema")

    @property
    def json_format(self) -> bool:
        return self.response_format is not None and self.response_format.type != "text"

    @property
    def parse_tools(self) -> bool:
        """Whether the answer is searched for tool calls (`tool_choice: none` shows tools but parses no call)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tools(self) -> list[Tool]:
        """The tools the answer must call (tool_choice required or named), enforced by a grammar; else []."""
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return []
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.tools if t.function.name == self.tool_choice.function.name]
        return list(self.tools)

    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or ()]

    def tool_schemas(self) -> dict[str, Any]:
        """Tool name -> its `parameters` schema: formats that write values as text type them by it (Qwen3-Coder)."""
        return {t.function.name: t.function.parameters or {} for t in self.tools or ()}

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None
