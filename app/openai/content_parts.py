"""Chat message content parts: text, and images as OpenAI's chat API sends them (`image_url`), for vision models.

Every API's image becomes one `ImageUrlPart`: chat's own `image_url` part, Anthropic's `image` block
(app/anthropic/protocol.py) and the Responses API's `input_image` part (app/openai/responses/items.py). Each part
keeps the path its client sent it under (`_field`), so that a 400 about an image names the field of the client's
own request: `messages.0.content.1.image_url` (chat), `messages.0.content.1.source` (Anthropic),
`input.0.content.1.image_url` (Responses). Fetching, decoding and bounds are app/images.py's.

A list of parts is validated by itself (`checked_content`), so that a bad part's 400 names its path,
`messages.0.content.1.image_url.url`, rather than a branch of the union (`messages.0.content.str`) or the
discriminator's tag (`messages.0.content.1.image_url.image_url.url`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, TypeAdapter, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from app.errors import InvalidRequest

Detail = Literal["auto", "low", "high"]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    url: str = Field(min_length=1, description="a data: URL (base64), or an http(s) URL on a host IMAGE_URL_HOSTS "
                                               "names (docs/limits.md)")
    detail: Detail = "auto"


class ImageUrlPart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageUrl
    # the path the client sent this image under: the chat path unless another API's rewrite set its own
    _field: str | None = PrivateAttr(default=None)


def image_part(url: str, field: str, detail: Detail = "auto") -> ImageUrlPart:
    """An image another API sent (Anthropic's `image` block, Responses' `input_image`), named by its own path."""
    part = ImageUrlPart(type="image_url", image_url=ImageUrl(url=url, detail=detail))
    part._field = field
    return part


ContentPart = Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]
_PARTS = TypeAdapter(list[ContentPart])


def checked_content(content: Any, handler: Any) -> Any:
    """ChatMessage.content's wrap validator: a string and None as they are, a list validated as parts alone."""
    if content is None or isinstance(content, str):
        return handler(content)
    if not isinstance(content, list):
        raise PydanticCustomError("content_type", "must be a string or a list of content parts")
    try:
        return _PARTS.validate_python(content)
    except ValidationError as err:
        raise untagged(err) from None


def untagged(err: ValidationError) -> ValidationError:
    """The same errors, each located without the union's tag (`1.image_url.image_url.url` -> `1.image_url.url`);
    a part of no known type is located at its `type`."""
    details = []
    for e in err.errors():
        loc = e["loc"]
        if e["type"] in ("union_tag_invalid", "union_tag_not_found"):
            loc = (*loc, "type")
        elif len(loc) > 1:  # (part index, tag, field...)
            loc = (loc[0], *loc[2:])
        # the message as pydantic wrote it (without a context, nothing in it is filled in again)
        details.append(InitErrorDetails(type=PydanticCustomError(e["type"], e["msg"]), loc=loc, input=e["input"]))
    return ValidationError.from_exception_data(err.title, details)


def name_image_fields(messages: list[Any], at: str = "messages") -> None:
    """Each chat image part not named by a rewrite gets its chat path, `messages.{i}.content.{j}.image_url`."""
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if isinstance(part, ImageUrlPart) and part._field is None:
                part._field = f"{at}.{i}.content.{j}.image_url"


def message_images(messages: list[Any]) -> list[tuple[str, str]]:
    """(url, the field the client sent it under) for every image part, in prompt order. Only user messages may
    hold images (OpenAI's rule): one anywhere else is a 400 naming its field."""
    images = []
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if isinstance(part, ImageUrlPart):
                field = part._field or f"messages.{i}.content.{j}.image_url"
                if message.role != "user":
                    raise InvalidRequest(f"only user messages may hold images; the one at {field} is in a "
                                         f"message of role {message.role!r}", param=field)
                images.append((part.image_url.url, field))
    return images


class WithImages(BaseModel):
    """A request with `messages` (chat, /tokenize): its images named by their chat path where no rewrite named
    them, and listed by `image_parts`."""

    @model_validator(mode="after")
    def _name_images(self) -> WithImages:
        name_image_fields(getattr(self, "messages", None) or [])
        return self

    def image_parts(self) -> list[tuple[str, str]]:
        """(url, the field its client sent it under) for every image part, in prompt order."""
        return message_images(getattr(self, "messages", None) or [])


def template_content(parts: list[TextPart | ImageUrlPart]) -> list[dict[str, str]]:
    """A message's parts as a multimodal chat template reads them (Hugging Face's processors' convention): an image
    is `{"type": "image"}`, where the template writes the model's image placeholder, text is its text."""
    return [{"type": "image"} if isinstance(part, ImageUrlPart) else {"type": "text", "text": part.text}
            for part in parts]


def refuse_images(images: list[tuple[str, str]], model_id: str) -> None:
    """A text-only model's 400 for a prompt with images, naming the first image's field (in the message too:
    Anthropic's error shape has no `param`). An image is never silently dropped."""
    if images:
        field = images[0][1]
        raise InvalidRequest(f"model {model_id!r} does not take images: it reads text only (an image was sent at "
                             f"{field}); serve a vision-language model to send images", param=field)
