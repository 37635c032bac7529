"""Images over HTTP to a vision model (the tests' tiny random LLaVA, tests/vision_models.py): each API's wire format
gets a 200 whose tokens are HF `generate()`'s on the processor's inputs, the same image twice hits the prefix cache,
and a hostile or out-of-bounds image gets a 400 naming what was wrong, quickly and without growing the server."""

from __future__ import annotations

import base64
import io
import time
import zlib

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

GREEDY = {"temperature": 0, "max_tokens": 6}


def png_url(seed: int, size=(40, 52)) -> str:
    out = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(*size, 3) * 255).astype("uint8")).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A PNG of a few hundred bytes whose header declares width x height pixels (a decompression bomb)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")
    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def chat_body(*urls: str, text: str = "what is in this picture?") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    return {"model": "tiny-llava", "messages": [{"role": "user", "content": parts}], **GREEDY}


@pytest.fixture(scope="module")
def server(tiny_vlm):
    from app.config import Settings
    from app.main import create_app
    from conftest import ThreadServer

    with ThreadServer(create_app(Settings(model="tiny-llava", max_images_per_request=2), lm=tiny_vlm)) as srv:
        yield srv


def expected(tiny_vlm, url: str, text: str = "what is in this picture?") -> str:
    """What HF generate() answers for this image and text (fp32 greedy), decoded."""
    from app.images import ImageLimits, load_image

    vlm, processor = tiny_vlm.vision.vlm, tiny_vlm.vision.processor
    content = [{"type": "image"}, {"type": "text", "text": text}]
    prompt = tiny_vlm.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                    add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[load_image(url, "x", ImageLimits()).image], return_tensors="pt")
    out = vlm.generate(**inputs, max_new_tokens=GREEDY["max_tokens"], do_sample=False)
    return tiny_vlm.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])


def test_the_openai_sdk_sends_an_image_url_and_gets_generates_answer(server, tiny_vlm):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    red = png_url(1)
    answer = client.chat.completions.create(**chat_body(red))
    assert answer.choices[0].message.content == expected(tiny_vlm, red)
    assert answer.usage.prompt_tokens > 16  # the image's 16 placeholder tokens are counted
    streamed = client.chat.completions.create(**chat_body(red), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected(tiny_vlm, red)


def test_the_same_image_twice_hits_the_prefix_cache_and_another_image_does_not(server):
    first = httpx.post(server.url + "/v1/chat/completions", json=chat_body(png_url(7), text="describe " * 20)).json()
    again = httpx.post(server.url + "/v1/chat/completions", json=chat_body(png_url(7), text="describe " * 20)).json()
    other = httpx.post(server.url + "/v1/chat/completions", json=chat_body(png_url(8), text="describe " * 20)).json()
    cached = lambda a: (a["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert cached(again) > 16 and again["choices"][0]["message"] == first["choices"][0]["message"]
    assert cached(other) < 16  # the placeholders' ids are the same; the pixels are not


def test_the_anthropic_sdk_sends_an_image_block(server, tiny_vlm):
    import anthropic  # here: the SDK takes seconds to import, and every worker collects this file

    red = png_url(1)
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    answer = client.messages.create(model="tiny-llava", max_tokens=6, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": red.split(",", 1)[1]}},
        {"type": "text", "text": "what is in this picture?"}]}])
    assert answer.content[0].text == expected(tiny_vlm, red)


def test_the_responses_api_sends_an_input_image(server, tiny_vlm):
    red = png_url(1)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    answer = client.responses.create(model="tiny-llava", temperature=0, max_output_tokens=6, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": red, "detail": "auto"},
                                     {"type": "input_text", "text": "what is in this picture?"}]}])
    assert answer.output_text == expected(tiny_vlm, red)


def rss_kib(pid: int | None = None) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))


def test_a_1_kb_png_declaring_10_gigapixels_is_a_400_in_under_a_second_with_no_memory_spent(server):
    bomb = bomb_png()
    assert len(bomb) < 1024
    url = "data:image/png;base64," + base64.b64encode(bomb).decode()
    before = rss_kib()
    started = time.perf_counter()
    answer = httpx.post(server.url + "/v1/chat/completions", json=chat_body(url))
    took = time.perf_counter() - started
    assert answer.status_code == 400 and took < 1.0
    assert answer.json()["error"]["param"] == "messages.0.content.0.image_url"
    assert "MAX_IMAGE_PIXELS" in answer.json()["error"]["message"]
    assert rss_kib() - before < 50 * 1024  # the server runs in this process: its RSS did not grow by the pixels


def test_a_url_image_with_fetching_off_is_a_400_naming_the_setting(server):
    answer = httpx.post(server.url + "/v1/chat/completions", json=chat_body("http://169.254.169.254/latest/x.png"))
    assert answer.status_code == 400
    assert "IMAGE_URL_HOSTS" in answer.json()["error"]["message"]
    assert answer.json()["error"]["param"] == "messages.0.content.0.image_url"


def test_too_many_images_is_a_400_naming_the_bound(server):
    answer = httpx.post(server.url + "/v1/chat/completions", json=chat_body(png_url(1), png_url(2), png_url(3)))
    assert answer.status_code == 400
    assert "MAX_IMAGES_PER_REQUEST" in answer.json()["error"]["message"]


def test_a_completion_of_text_still_works_on_a_vision_model(server):
    answer = httpx.post(server.url + "/v1/completions", json={"model": "tiny-llava", "prompt": "hello", **GREEDY})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 6


def test_tokenize_counts_an_image_as_the_tokens_a_completion_gets(server):
    messages = chat_body(png_url(1))["messages"]
    counted = httpx.post(server.url + "/tokenize", json={"model": "tiny-llava", "messages": messages}).json()
    answer = httpx.post(server.url + "/v1/chat/completions", json=chat_body(png_url(1))).json()
    assert counted["count"] == answer["usage"]["prompt_tokens"]
