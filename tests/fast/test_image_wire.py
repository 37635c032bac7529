"""Images on the wire: chat's `image_url` parts, Anthropic's `image` blocks and the Responses API's `input_image`
parts all become the chat request's image parts, each named by the field its client sent it under; a model that
reads text only answers each API with a 400 naming that field, never an answer that silently dropped the image.

The vision side (images decoded and placed in the prompt) is tested in tests/fast/test_vision.py.
"""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
from PIL import Image

from app.anthropic.protocol import MessagesRequest
from app.body import BodyLimits, check_counts
from app.errors import InvalidRequest
from app.openai.protocol import ChatCompletionRequest, TokenizeRequest
from app.openai.responses.protocol import ResponsesRequest


def png_base64(color: tuple[int, int, int] = (200, 30, 30)) -> str:
    """A real 8x8 PNG, base64."""
    out = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


PNG = png_base64()
DATA_URL = f"data:image/png;base64,{PNG}"
BLUE_URL = f"data:image/png;base64,{png_base64((0, 0, 255))}"


def chat(messages: list[dict]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "tiny", "messages": messages})


def image(url: str = DATA_URL, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def refused(make) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        make()
    return info.value


# The conversions, without a server


def test_chat_image_parts_are_listed_in_prompt_order_with_their_chat_paths():
    body = chat([{"role": "system", "content": "Describe images."},
                 {"role": "user", "content": [{"type": "text", "text": "Compare "}, image(detail="low"),
                                              {"type": "text", "text": " with "}, image(BLUE_URL)]},
                 {"role": "assistant", "content": "Red and blue."},
                 {"role": "user", "content": [image()]}])
    assert body.image_parts() == [(DATA_URL, "messages.1.content.1.image_url"),
                                  (BLUE_URL, "messages.1.content.3.image_url"),
                                  (DATA_URL, "messages.3.content.0.image_url")]
    assert body.messages[1].content[1].image_url.detail == "low"
    assert body.messages[1].text() == "Compare  with "  # the text alone, as before


def test_a_message_with_images_renders_as_the_multimodal_template_list_and_others_stay_strings():
    body = chat([{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": [{"type": "text", "text": "What is "}, image(),
                                              {"type": "text", "text": "?"}]},
                 {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert body.chat_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "image"},
                                     {"type": "text", "text": "?"}]},
        {"role": "user", "content": "ab"}]  # text parts without images: one string, exactly as before


def test_a_text_only_conversation_renders_exactly_as_before():
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello", "reasoning_content": "greet"},
                {"role": "user", "content": [{"type": "text", "text": "Bye"}]}]
    assert chat(messages).chat_messages() == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "greet"}, {"role": "user", "content": "Bye"}]
    assert chat(messages).image_parts() == []
    tokenize = TokenizeRequest.model_validate({"messages": messages})
    assert tokenize.chat_messages() == chat(messages).chat_messages() and tokenize.image_parts() == []


def test_an_image_outside_a_user_message_is_refused_by_its_field():
    body = chat([{"role": "system", "content": [image()]}, {"role": "user", "content": "Hi"}])
    for call in (body.image_parts, body.chat_messages):
        err = refused(call)
        assert err.param == "messages.0.content.0.image_url" and "user messages" in err.message


@pytest.mark.parametrize("part, param", [
    ({"type": "image_url"}, "messages.0.content.1.image_url"),
    ({"type": "image_url", "image_url": {"url": ""}}, "messages.0.content.1.image_url.url"),
    ({"type": "image_url", "image_url": {"url": DATA_URL, "detail": "max"}}, "messages.0.content.1.image_url.detail"),
    ({"type": "input_audio", "input_audio": {}}, "messages.0.content.1.type"),
    ({"type": "text"}, "messages.0.content.1.text"),
])
def test_a_bad_part_is_a_400_naming_its_path(make_tiny_server, part, param):
    server = make_tiny_server()
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, part]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_anthropic_image_blocks_become_image_parts_named_by_their_source():
    body = MessagesRequest.model_validate({"model": "tiny", "max_tokens": 5, "system": "Look.", "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "First"}, {"type": "text", "text": "this:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]},
        {"role": "assistant", "content": "A square."},
        {"role": "user", "content": [{"type": "text", "text": "And"}, {"type": "text", "text": "now?"}]}]})
    request = body.to_chat_request(reasons=False)
    assert request.image_parts() == [(DATA_URL, "messages.0.content.2.source"),
                                     ("https://example.com/cat.png", "messages.0.content.3.source")]
    assert request.chat_messages() == [
        {"role": "system", "content": "Look."},
        {"role": "user", "content": [{"type": "text", "text": "First\n\nthis:"}, {"type": "image"}, {"type": "image"}]},
        {"role": "assistant", "content": "A square."},
        {"role": "user", "content": "And\n\nnow?"}]  # text blocks alone: joined by a blank line, as before


@pytest.mark.parametrize("block, param", [
    ({"type": "image", "source": {"type": "base64", "media_type": "image/bmp", "data": PNG}},
     "messages.0.content.0.source.media_type"),
    ({"type": "image", "source": {"type": "base64", "media_type": "image/png"}}, "messages.0.content.0.source.data"),
    ({"type": "image", "source": {"type": "file", "file_id": "file_1"}}, "messages.0.content.0.source.type"),
])
def test_a_bad_anthropic_image_source_is_refused_by_its_field(block, param):
    body = MessagesRequest.model_validate({"model": "tiny", "max_tokens": 5,
                                           "messages": [{"role": "user", "content": [block]}]})
    assert refused(lambda: body.to_chat_request(reasons=False)).param == param


def test_responses_input_image_parts_become_image_parts_named_by_their_input_path():
    body = ResponsesRequest.model_validate({"model": "tiny", "instructions": "Look.", "input": [
        {"role": "user", "content": "Hello"},
        {"role": "user", "content": [{"type": "input_text", "text": "What is "},
                                     {"type": "input_image", "image_url": DATA_URL, "detail": "high"}]}]})
    request = body.to_chat_request()
    assert request.image_parts() == [(DATA_URL, "input.1.content.1.image_url")]
    assert request.messages[2].content[1].image_url.detail == "high"
    assert request.chat_messages() == [
        {"role": "system", "content": "Look."}, {"role": "user", "content": "Hello"},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "image"}]}]


@pytest.mark.parametrize("part, param", [
    ({"type": "input_image", "file_id": "file_1"}, "input.0.content.0.file_id"),
    ({"type": "input_image"}, "input.0.content.0.image_url"),
    ({"type": "input_image", "image_url": DATA_URL, "detail": "max"}, "input.0.content.0.detail"),
    ({"type": "input_audio"}, "input.0.content.0.type"),
])
def test_a_bad_responses_image_part_is_refused_by_its_field(part, param):
    body = ResponsesRequest.model_validate({"model": "tiny", "input": [{"role": "user", "content": [part]}]})
    err = refused(body.to_chat_request)
    assert err.param == param and "{" not in err.message, err.message


def test_image_parts_count_as_content_blocks():
    limits = BodyLimits(max_content_blocks=2)
    three = [{"type": "text", "text": "a"}, image(), image()]
    for body in ({"messages": [{"role": "user", "content": three}]},
                 {"input": [{"role": "user", "content": three}]}):
        with pytest.raises(InvalidRequest, match="MAX_CONTENT_BLOCKS"):
            check_counts(body, limits)
    check_counts({"messages": [{"role": "user", "content": three[:2]}]}, limits)  # at the bound: accepted


# Over HTTP, with the official SDKs, against a model that reads text only


@pytest.fixture
def tiny(make_tiny_server):
    return make_tiny_server()


def test_openai_sdk_image_url_to_a_text_model_is_a_400_naming_the_part(tiny):
    client = openai.OpenAI(base_url=tiny.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": DATA_URL}}]}])
    assert info.value.body["param"] == "messages.0.content.1.image_url"
    assert "does not take images" in info.value.body["message"]
    # /tokenize renders the same prompt: the same 400, not a count without the image
    r = httpx.post(tiny.url + "/tokenize", json={"messages": [{"role": "user", "content": [image()]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.0.image_url", r.text


def test_anthropic_sdk_image_block_to_a_text_model_is_a_400_naming_the_block(tiny):
    import anthropic  # here: the SDK takes seconds to import, and every worker collects this file

    client = anthropic.Anthropic(base_url=tiny.url, api_key="unused", max_retries=0)
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]
    for call in (client.messages.create, client.messages.count_tokens):
        extra = {"max_tokens": 4} if call == client.messages.create else {}
        with pytest.raises(anthropic.BadRequestError) as info:
            call(model="tiny", messages=[{"role": "user", "content": content}], **extra)
        error = info.value.body["error"]  # Anthropic's shape has no `param`: the message names the field
        assert error["type"] == "invalid_request_error"
        assert "does not take images" in error["message"] and "messages.0.content.1.source" in error["message"]


def test_responses_input_image_to_a_text_model_is_a_400_naming_the_part(tiny):
    client = openai.OpenAI(base_url=tiny.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", max_output_tokens=4, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                         {"type": "input_image", "image_url": DATA_URL, "detail": "auto"}]}])
    assert info.value.body["param"] == "input.0.content.1.image_url"


def test_completions_still_take_text_alone(tiny):
    r = httpx.post(tiny.url + "/v1/completions", timeout=30,
                   json={"model": "tiny", "max_tokens": 1, "prompt": [image()]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt"), r.text
