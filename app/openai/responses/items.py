"""The Responses API's input items as typed models, a union discriminated by `type`, and the chat messages they mean.

Each item is validated on its own against its model, so that a malformed one is a 400 naming its field
(`input.2.content.0.text`), never a TypeError deep in the conversion (`{"type": "reasoning", "content": 5}`
was a 500). A message item may leave out `type` (OpenAI's easy input message); `content` and a function call's
`output` may be a string or a list of text parts, and a message's content may hold `input_image` parts too (each
becomes a chat image part named `input.{i}.content.{j}.image_url`); an earlier answer's `reasoning` item is kept for
the assistant turn it belongs to.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError,
                      field_validator)
from pydantic_core import PydanticCustomError

from app.errors import InvalidRequest
from app.openai.content_parts import Detail, ImageUrlPart, TextPart as ChatTextPart, image_part

TEXT_PARTS = ("input_text", "output_text", "text")  # output_text: the text of an earlier answer


def _as_parts(value: Any) -> Any:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "input_text", "text": value}]
    if not isinstance(value, list):
        raise PydanticCustomError("content_type", "must be a string or a list of text parts")
    return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # annotations, logprobs of an earlier answer
    type: str
    text: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind not in TEXT_PARTS:
            raise PydanticCustomError("unsupported_part", "content parts of type '{kind}' are not supported: text "
                                      "parts are, and input_image in a message", {"kind": kind})
        return kind


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["input_image"]
    image_url: str | None = None  # a data: URL, or an http(s) URL on a host IMAGE_URL_HOSTS names
    file_id: str | None = None  # refused: files are not served as images here
    detail: Detail = "auto"


def _part_kind(part: Any) -> str:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return "image_part" if kind == "input_image" else "text_part"  # any other type: TextPart says what is wrong


PART_TAGS = ("text_part", "image_part")  # left out of an error's location, which names the client's own fields
# a string, or parts: one list, so that an error's location names the field and not a branch of a union
Content = Annotated[list[TextPart], BeforeValidator(_as_parts)]
MessagePart = Annotated[Annotated[TextPart, Tag("text_part")] | Annotated[ImagePart, Tag("image_part")],
                        Discriminator(_part_kind)]
MessageContent = Annotated[list[MessagePart], BeforeValidator(_as_parts)]


class _Item(BaseModel):
    model_config = ConfigDict(extra="allow")  # id, status: an earlier answer's items come back as they were


class MessageItem(_Item):
    type: Literal["message"]
    role: Literal["user", "system", "developer", "assistant"]
    content: MessageContent

    def chat_content(self, i: int) -> str | list:
        """The chat message's content: its text, or its parts in order where it holds images."""
        if not any(isinstance(part, ImagePart) for part in self.content):
            return "".join(part.text for part in self.content)
        return [chat_image(part, f"input.{i}.content.{j}") if isinstance(part, ImagePart)
                else ChatTextPart(type="text", text=part.text) for j, part in enumerate(self.content)]


def chat_image(part: ImagePart, where: str) -> ImageUrlPart:
    """An `input_image` part as a chat image part, named by its client's path."""
    if part.file_id is not None:
        raise InvalidRequest("`file_id` images are not supported: files are not served as images here; send the "
                             "image as a data: URL in `image_url`", param=f"{where}.file_id")
    if not part.image_url:
        raise InvalidRequest("an input_image needs its `image_url`", param=f"{where}.image_url")
    return image_part(part.image_url, f"{where}.image_url", part.detail)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str = "{}"  # a JSON string, as in chat tool calls


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Content


class ReasoningText(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning_text", "summary_text", "text"] = "reasoning_text"
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[ReasoningText] | None = None

    def text(self) -> str | None:
        return "".join(part.text for part in self.content or self.summary or []) or None


class ItemReference(_Item):
    type: Literal["item_reference"]
    id: str | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | ItemReference,
                      Field(discriminator="type")]
_INPUT_ITEM = TypeAdapter(InputItem)
KINDS = ("message", "function_call", "function_call_output", "reasoning", "item_reference")


def input_item(raw: Any, i: int) -> MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem:
    """`input[i]` as its typed model, or a 400 naming the field that is wrong."""
    if not isinstance(raw, dict):
        raise InvalidRequest("each input item must be an object", param=f"input.{i}")
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind not in KINDS:
        raise InvalidRequest(f"input items of type {kind!r} are not supported (message, function_call, "
                             "function_call_output and reasoning are)", param=f"input.{i}.type")
    try:
        item = _INPUT_ITEM.validate_python({**raw, "type": kind})
    except ValidationError as err:
        first = err.errors()[0]
        # loc[0]: the union's tag; a content part's tag is no field either
        where = ".".join(str(part) for part in (f"input.{i}", *first["loc"][1:]) if part not in PART_TAGS)
        raise InvalidRequest(f"{where}: {first['msg']}", param=where) from err
    if isinstance(item, ItemReference):
        raise InvalidRequest("`item_reference` needs stored responses, which this server does not keep",
                             param=f"input.{i}")
    return item


def input_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items -> chat messages: a function call joins the assistant turn before it (calls of one turn share
    one message), its output is a `tool` message, a reasoning item's text waits for the assistant turn it is of."""
    messages: list[dict[str, Any]] = []
    thought: str | None = None
    for i, raw in enumerate(items):
        item = input_item(raw, i)
        if isinstance(item, MessageItem):
            message = {"role": item.role, "content": item.chat_content(i)}
            if item.role == "assistant" and thought:
                message["reasoning_content"], thought = thought, None
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if thought:
                    messages[-1]["reasoning_content"], thought = thought, None
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": "".join(part.text for part in item.output)})
        else:
            thought = item.text()
    return messages
