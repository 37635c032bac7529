"""The playground (GET /) in a real browser: Debian's chromium driven by Playwright, against a real server on loopback.

Every page runs with every request routed through the test: anything not addressed to 127.0.0.1 is aborted and fails
the test, and so does any console error. `make chromium` installs the browser (`make test` does it first).
`UPDATE_SCREENSHOT=1` (`make screenshot`) writes the README's picture, docs/playground.png.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright

from app.config import Settings

REPO = Path(__file__).resolve().parents[2]
SCREENSHOT = REPO / "docs" / "playground.png"
WEB_FILES = ("index.html", "playground.js", "inspector.js", "attach.js", "playground.css")
CONTROLS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def test_the_page_and_its_files_are_served_and_need_nothing_from_outside(make_tiny_server):
    server = make_tiny_server(api_key="secret")  # the page itself is public; the API behind it is not
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name in WEB_FILES:
        served = httpx.get(f"{server.url}/web/{name}")
        assert served.status_code == 200
        # no CDN, no web font, no absolute URL of any kind: the playground works offline
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]", served.text.replace("://127.0.0.1", "")), name
    assert httpx.get(server.url + "/web/nothing.js").status_code == 404
    assert httpx.get(server.url + "/v1/models").status_code == 401


def test_the_wheel_ships_the_page(tmp_path):
    """The Docker image pip-installs the package: the static files must be package data, not just files in git."""
    source = tmp_path / "src"  # a copy of what the Dockerfile copies, so the build leaves nothing in the repo
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "app", source / "app", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "--wheel-dir", str(tmp_path), str(source)], check=True, capture_output=True, timeout=300)
    wheel, = tmp_path.glob("simple_serve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert all(f"app/web/{name}" in names for name in WEB_FILES), names


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is not installed: `make chromium` installs it"
    with sync_playwright() as playwright:
        # Playwright's own browser download is not reachable here: drive the system's chromium instead.
        browser = playwright.chromium.launch(executable_path=chromium,
                                             args=["--no-sandbox"] if os.geteuid() == 0 else [])
        yield browser
        browser.close()


class Page:
    """A fresh browser context on the playground, recording console errors and every request it makes."""

    def __init__(self, browser, url: str, height: int = 760):
        self.context = browser.new_context(viewport={"width": 1280, "height": height})
        self.local: list[str] = []
        self.outside: list[str] = []
        self.errors: list[str] = []
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("console", lambda msg: self.errors.append(msg.text) if msg.type == "error" else None)
        self.page.on("pageerror", lambda err: self.errors.append(str(err)))
        self.page.goto(url + "/")

    def _route(self, route) -> None:
        parts = urlsplit(route.request.url)
        if parts.scheme in ("data", "blob") or parts.hostname == "127.0.0.1":
            self.local.append(parts.path)
            route.continue_()
        else:
            self.outside.append(route.request.url)
            route.abort()

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def open_page(browser):
    pages: list[Page] = []

    def open_(url: str, height: int = 760) -> Page:
        pages.append(Page(browser, url, height))
        return pages[-1]

    yield open_
    for page in pages:
        page.close()


def sse_choices(body: str) -> list[dict]:
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    return [e["choices"][0] for e in events if e.get("choices")]


def token_groups(choices: list[dict]) -> list[tuple[str, list[dict]]]:
    """What each span of the answer holds: its text and the inspections of the tokens behind it (as the page
    groups them: tokens without text yet join the next token with text; what is left at the end, its own span)."""
    groups, pending = [], []
    for choice in choices:
        if "inspect" in choice:
            pending.append(choice["inspect"])
        text = choice.get("delta", {}).get("content", "")
        if text:
            groups.append((text, pending))
            pending = []
    if pending:
        groups.append(("".join(p["token"]["text"] for p in pending), pending))
    return groups


def visible(text: str) -> str:
    return text.replace(" ", "\u2423").replace("\n", "\u21b5").replace("\t", "\u21e5")


def check_inspector_shows(page, entries: list[dict]) -> None:
    """The inspector shows one table per token behind the span, each exactly the API's."""
    tables = page.locator("#inspector-body table.stages")
    expect(tables.first).to_be_visible()
    assert tables.count() == len(entries)
    for i, entry in enumerate(entries):
        check_table_matches(tables.nth(i), entry)


def check_table_matches(table, entry: dict) -> None:
    """The table shows exactly the API's candidates, probabilities and drawn token."""
    assert table.locator("th[data-stage]").evaluate_all("ths => ths.map(th => th.dataset.stage)") == entry["stages"]
    rows = table.locator("tbody tr")
    assert rows.count() == len(entry["candidates"])
    for i, candidate in enumerate(entry["candidates"]):
        row = rows.nth(i)
        cells = row.locator("td").all_inner_texts()
        drawn = candidate["id"] == entry["token"]["id"]
        assert cells[0] == ("\u2605 " if drawn else "") + f"'{visible(candidate['text'])}'"
        assert ("drawn" in (row.get_attribute("class") or "")) == drawn
        for shown, p in zip(cells[1:], candidate["probs"], strict=True):
            if p == 0:
                assert shown == "cut"
            elif p < 0.0005:
                assert shown == "<0.001"
            else:
                assert float(shown) == pytest.approx(p, abs=0.0005 + 1e-9), (candidate, shown)


def record_streaming(page) -> None:
    """Note the answer's length at every change while it is still streaming."""
    page.evaluate("""() => {
        window.partialLengths = [];
        new MutationObserver(() => {
            const answer = document.querySelector('.message.assistant.streaming .content');
            if (answer) window.partialLengths.push(answer.textContent.length);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")


def ask(page, prompt: str):
    """Type a prompt, send it, and return the chat completion's response once the answer is complete."""
    page.fill("#prompt", prompt)
    with page.expect_response("**/v1/chat/completions") as response:
        page.press("#prompt", "Enter")
    expect(page.locator(".message.assistant").last).not_to_have_class("message assistant streaming", timeout=60_000)
    expect(page.locator("#send")).to_be_enabled()
    return response.value


@pytest.mark.browser
def test_chat_streams_and_the_inspector_shows_the_apis_probabilities(make_tiny_server, open_page):
    server = make_tiny_server()
    p = open_page(server.url)
    page = p.page
    expect(page.locator("#model")).to_contain_text("tiny")
    defaults = httpx.get(server.url + "/v1/models").json()["data"][0]["sampling_defaults"]
    for name in CONTROLS:  # prefilled with the model's effective defaults
        assert float(page.input_value(f"#{name}")) == defaults[name]
    page.fill("#seed", "5")
    page.fill("#max_tokens", "40")
    page.fill("#system", "You are terse.")
    record_streaming(page)

    response = ask(page, "Which city is the capital of France?")
    request = response.request.post_data_json
    assert request["messages"][0] == {"role": "system", "content": "You are terse."}
    assert request["inspect"] == {"top": 10} and request["seed"] == 5 and request["stream"] is True
    partial = page.evaluate("window.partialLengths")
    assert len({n for n in partial if n > 0}) >= 3, partial  # the answer was shown piece by piece while streaming

    # the effective parameters under the answer are the response's x-sampling-params header
    effective = json.loads(response.headers["x-sampling-params"])
    params = page.locator(".message.assistant .meta .param[data-param]")
    shown = dict(zip(params.evaluate_all("els => els.map(e => e.dataset.param)"),
                     params.evaluate_all("els => els.map(e => e.dataset.value)")))
    assert set(shown) == {*CONTROLS, "seed", "max_tokens"}
    assert all(float(value) == effective[key] for key, value in shown.items())

    # every span of the answer is backed by the streamed inspections, and shows the API's numbers
    groups = token_groups(sse_choices(response.text()))
    spans = page.locator(".message.assistant .tok")
    assert spans.count() == len(groups) >= 3
    assert spans.all_text_contents() == [text for text, _ in groups]
    spans.nth(2).hover()
    check_inspector_shows(page, groups[2][1])
    spans.nth(0).click()  # pinned: moving the mouse elsewhere keeps this token's table
    spans.nth(2).hover()
    check_inspector_shows(page, groups[0][1])
    spans.last.focus()  # the keyboard reaches tokens too, once nothing is pinned
    spans.nth(0).click()
    spans.last.focus()
    check_inspector_shows(page, groups[-1][1])

    assert "/v1/chat/completions" in p.local and "/web/playground.js" in p.local
    assert p.outside == [] and p.errors == []


@pytest.mark.browser
def test_a_bad_setting_shows_the_servers_error(make_tiny_server, open_page):
    p = open_page(make_tiny_server().url)
    page = p.page
    expect(page.locator("#model")).to_contain_text("tiny")
    page.fill("#top_p", "5")
    response = ask(page, "hi")
    assert response.status == 400
    expect(page.locator(".message.assistant .error")).to_contain_text("top_p: Input should be less than or equal to 1")
    assert [e for e in p.errors if "status of 400" not in e] == []  # chromium logs the 400 itself
    assert p.outside == []


@pytest.mark.browser
def test_a_reasoning_models_thinking_is_shown_apart_and_inspectable(open_page):
    from tests.conftest import ThreadServer
    from test_reasoning import THINKS, _app, qwen3_tokenizer, scripted_lm

    with ThreadServer(_app(scripted_lm(qwen3_tokenizer(), THINKS))) as server:  # thinks "The Paris is", says "Paris"
        p = open_page(server.url)
        page = p.page
        expect(page.locator("#model")).to_contain_text("qwen3-tiny")
        page.fill("#temperature", "0")
        response = ask(page, "Which city is the capital of France?")
        answer = page.locator(".message.assistant")
        expect(answer.locator(".thinking .thought")).to_have_text("The Paris is")
        expect(answer.locator(".content .tok")).to_have_text(["Par", "is", "<|im_end|>"])
        entries = {c["inspect"]["token"]["text"]: c["inspect"] for c in sse_choices(response.text()) if "inspect" in c}
        answer.locator(".thinking .tok", has_text="Paris").click()
        check_inspector_shows(page, [entries[" Paris"]])
        answer.locator(".content .tok").first.click()  # the tokens that show no text join the next one that does
        check_inspector_shows(page, [entries["</think>"], entries["\n\n"], entries["Par"]])
        assert p.outside == [] and p.errors == []


def png(path: Path, color: str = "red", size: tuple[int, int] = (48, 40)) -> Path:
    from PIL import Image

    Image.new("RGB", size, color).save(path)
    return path


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def drop_or_paste(page, event: str, path: Path, mime: str = "image/png") -> None:
    """Drop a file on the message box (as a drag from the desktop does: dragover, then drop), or paste it."""
    page.evaluate("""([event, b64, mime]) => {
        const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
        const transfer = new DataTransfer();
        transfer.items.add(new File([bytes], 'dropped.png', {type: mime}));
        const box = document.getElementById('prompt');
        if (event === 'paste') {
            box.dispatchEvent(new ClipboardEvent('paste', {clipboardData: transfer, bubbles: true, cancelable: true}));
            return;
        }
        box.dispatchEvent(new DragEvent('dragover', {dataTransfer: transfer, bubbles: true, cancelable: true}));
        box.dispatchEvent(new DragEvent('drop', {dataTransfer: transfer, bubbles: true, cancelable: true}));
    }""", [event, base64.b64encode(path.read_bytes()).decode(), mime])


@pytest.mark.browser
def test_an_image_is_attached_sent_shown_and_kept_in_the_history(make_vision_server, open_page, tmp_path):
    server = make_vision_server()
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["capabilities"] == {"vision": True}
    p = open_page(server.url)
    page = p.page
    expect(page.locator("#model")).to_contain_text("tiny-llava")
    expect(page.locator("#attach")).to_be_visible()
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "8")

    blue, red = png(tmp_path / "blue.png", "blue"), png(tmp_path / "red.png", "red")
    page.set_input_files("#attach-file", str(blue))  # what the "Image…" button's file picker sets
    pending = page.locator("#attachment img.thumb")
    expect(pending).to_have_attribute("src", data_url(blue))
    page.click("#attachment button.remove")  # removed before sending: nothing is sent
    expect(page.locator("#attachment")).to_be_hidden()
    page.set_input_files("#attach-file", str(red))
    expect(pending).to_have_attribute("src", data_url(red))

    response = ask(page, "What colour is this?")
    assert response.status == 200
    sent = response.request.post_data_json["messages"]
    assert sent == [{"role": "user", "content": [{"type": "text", "text": "What colour is this?"},
                                                 {"type": "image_url", "image_url": {"url": data_url(red)}}]}]
    expect(page.locator("#attachment")).to_be_hidden()  # sent: the composer is empty again
    user = page.locator(".message.user")
    expect(user.locator("img.thumb")).to_have_attribute("src", data_url(red))
    expect(user.locator(".content")).to_have_text("What colour is this?")
    answer = page.locator(".message.assistant").last
    expect(answer.locator(".error")).to_have_count(0)
    # the tiny random model's words mean nothing; that it answered at all is what counts
    assert answer.locator(".content").text_content() and answer.locator(".content .tok").count() >= 1
    assert sse_choices(response.text())

    # a later turn sends the image again, in its turn; a message without one stays a plain string
    response = ask(page, "And now?")
    assert response.status == 200
    sent = response.request.post_data_json["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[0]["content"][1] == {"type": "image_url", "image_url": {"url": data_url(red)}}
    assert isinstance(sent[1]["content"], str) and sent[2]["content"] == "And now?"
    expect(page.locator(".message.user img.thumb")).to_have_count(1)
    assert p.outside == [] and p.errors == []


@pytest.mark.browser
def test_an_image_can_be_dropped_or_pasted_and_a_wrong_one_is_refused_before_sending(make_vision_server,
                                                                                     open_page, tmp_path):
    p = open_page(make_vision_server().url)
    page = p.page
    expect(page.locator("#attach")).to_be_visible()
    image = png(tmp_path / "green.png", "green")
    drop_or_paste(page, "drop", image)
    expect(page.locator("#attachment img.thumb")).to_have_attribute("src", data_url(image))
    page.click("#attachment button.remove")
    drop_or_paste(page, "paste", image)
    expect(page.locator("#attachment img.thumb")).to_have_attribute("src", data_url(image))

    # too big, or not an image: a message says so, and nothing is attached (the earlier image goes too)
    page.set_input_files("#attach-file", files=[{"name": "huge.png", "mimeType": "image/png",
                                                 "buffer": b"\x89PNG" + bytes(5 * 2**20)}])
    expect(page.locator("#attach-error")).to_contain_text("huge.png is 5.0 MB; images of at most 4.0 MB are sent")
    expect(page.locator("#attachment")).to_be_hidden()
    drop_or_paste(page, "drop", tmp_path / "green.png", mime="application/pdf")
    expect(page.locator("#attach-error")).to_contain_text("not an image this page sends (PNG, JPEG, WebP or GIF)")
    expect(page.locator("#attachment")).to_be_hidden()
    page.set_input_files("#attach-file", str(image))  # a good one clears the message
    expect(page.locator("#attach-error")).to_be_hidden()
    expect(page.locator("#attachment img.thumb")).to_be_visible()
    assert "/v1/chat/completions" not in p.local  # refusing sent nothing
    assert p.outside == [] and p.errors == []


@pytest.mark.browser
def test_a_text_only_model_offers_no_image_attachment(make_tiny_server, open_page, tmp_path):
    server = make_tiny_server()
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["capabilities"] == {"vision": False}
    p = open_page(server.url)
    page = p.page
    expect(page.locator("#model")).to_contain_text("context")  # the model's details have been read
    expect(page.locator("#attach")).to_be_hidden()
    drop_or_paste(page, "drop", png(tmp_path / "red.png"))  # a drop is not taken either
    expect(page.locator("#attachment")).to_be_hidden()
    page.fill("#max_tokens", "8")  # the tiny model's context is 256 tokens, the page's default max_tokens too
    response = ask(page, "hi")
    assert response.request.post_data_json["messages"] == [{"role": "user", "content": "hi"}]
    assert response.status == 200, response.text()
    assert p.outside == [] and p.errors == []


@pytest.mark.browser
@pytest.mark.real_model
def test_a_real_answer_inspected_makes_the_readme_picture(smollm_fp32, open_page, tmp_path):
    from app.main import create_app
    from tests.conftest import ThreadServer

    with ThreadServer(create_app(Settings(model="smollm2-135m-instruct"), lm=smollm_fp32)) as server:
        p = open_page(server.url, height=880)  # tall enough for the whole table in the picture
        page = p.page
        expect(page.locator("#model")).to_contain_text("smollm2-135m-instruct")
        # SmolLM2 ships no sampling defaults: set Qwen2.5's, so that every stage has something to do
        for name, value in dict(temperature="0.7", top_k="20", top_p="0.8", repetition_penalty="1.1", seed="3",
                                max_tokens="40").items():
            page.fill(f"#{name}", value)
        page.fill("#prompt", "Which city is the capital of France? Answer in one sentence.")
        with page.expect_response("**/v1/chat/completions") as response_info:
            page.click("#send")
            # seen mid-answer: a token is on the page while the answer is still streaming
            expect(page.locator(".message.assistant.streaming .tok").first).to_be_visible(timeout=60_000)
        expect(page.locator(".message.assistant").last).not_to_have_class("message assistant streaming",
                                                                          timeout=120_000)
        groups = token_groups(sse_choices(response_info.value.text()))
        # the picture: the first token where the sampler really had a choice (two candidates survive every stage)
        index = next((i for i, (_, entries) in enumerate(groups)
                      if sum(c["probs"][-1] > 0 for c in entries[-1]["candidates"]) >= 2), 0)
        page.locator(".message.assistant .tok").nth(index).click()
        check_inspector_shows(page, groups[index][1])
        target = SCREENSHOT if os.environ.get("UPDATE_SCREENSHOT") else tmp_path / SCREENSHOT.name
        page.screenshot(path=str(target))
        assert target.stat().st_size > 10_000
        assert p.outside == [] and p.errors == []
