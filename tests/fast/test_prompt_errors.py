"""Whatever goes wrong while a request becomes a prompt is that request's 400, on every API, and what the log gets
stays small and one line per record (issue 34, findings 1, 3 and the access log's forged lines).

On the tiny model over a real socket, in this process: values nested deeper than transformers or the JSON encoder
recurse, chat_template_kwargs that are apply_chat_template's own arguments, malformed Responses input items, a NaN
the response would have to repeat; and, for whatever still escapes every handler, a 500 whose traceback is bounded
and whose connection stays open."""

from __future__ import annotations

import json
import logging
import time
import sys

import httpx
import pytest

from app.logs import MAX_TRACEBACK_CHARS, LogFormatter, bounded_traceback

DEPTH = 600  # a 1.5 KB body; transformers' message conversion recursed past Python's limit at about 480
DEEP_TEXT = '{"x": ' + "[" * DEPTH + "1" + "]" * DEPTH + "}"
DEEP = json.loads(DEEP_TEXT)
HI = {"role": "user", "content": "hi"}
NaN = float("nan")


def deep_chat() -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP_TEXT}}
    return {"model": "tiny", "max_tokens": 1, "messages": [
        HI, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}


def deep_messages(value=DEEP) -> dict:
    return {"model": "tiny", "max_tokens": 1, "messages": [
        HI, {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "f", "input": value}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "ok"}]}]}


def deep_responses() -> dict:
    return {"model": "tiny", "max_output_tokens": 1, "input": [
        HI, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP_TEXT},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.fixture(scope="module")
def tiny(tiny_lm):
    from conftest import ThreadServer

    from app.config import Settings
    from app.main import create_app

    with ThreadServer(create_app(Settings(model="tiny"), lm=tiny_lm)) as server:
        yield server.url


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def openai_error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    return error


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", deep_chat()),
                                        ("/v1/responses", deep_responses())])
def test_a_deeply_nested_tool_call_is_a_400_not_a_500(tiny, path, body):
    error = openai_error(post(tiny, path, body))
    assert "nested too deeply" in error["message"]
    assert error["param"] == ("messages" if path.endswith("completions") else "input")


def test_a_deeply_nested_tool_use_input_is_an_anthropic_400(tiny):
    r = post(tiny, "/v1/messages", deep_messages())
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


def test_deeper_than_the_json_encoder_goes_is_a_400_in_the_conversion_itself():
    """Defence in depth, past any parse-time limit: a tool_use input or a repeated field the encoder cannot write
    (built here, as no JSON parser would hand it over) is a 400 naming it."""
    from app.anthropic.protocol import MessagesRequest
    from app.errors import InvalidRequest
    from app.openai.responses.serving import check_echo
    from app.openai.responses.protocol import ResponsesRequest

    with pytest.raises(InvalidRequest, match="nested too deeply") as caught:
        MessagesRequest.model_validate(deep_messages(nested(1100))).to_chat_request(reasons=False)
    assert caught.value.param == "messages.1.content.0.input"
    for value, said in ((nested(1100), "nested too deeply"), (NaN, "JSON")):
        body = ResponsesRequest.model_validate({"model": "tiny", "input": "hi", "text": {"format": {
            "type": "text", "x": value}}})
        with pytest.raises(InvalidRequest, match=said) as caught:
            check_echo(body)
        assert caught.value.param == "text"


def test_whatever_the_template_raises_is_a_400(tiny_lm, monkeypatch):
    from app.errors import InvalidRequest

    for err in (RecursionError("maximum recursion depth exceeded"), TypeError("unhashable type: 'dict'"),
                KeyError("role")):
        def raising(*args, err=err, **kwargs):
            raise err

        monkeypatch.setattr(tiny_lm.tokenizer, "apply_chat_template", raising)
        with pytest.raises(InvalidRequest) as caught:
            tiny_lm.encode_chat([HI])
        assert caught.value.param == "messages" and caught.value.status == 400


@pytest.mark.parametrize("stream", [False, True])
def test_a_nan_the_response_would_repeat_is_a_400_not_a_bare_nan(tiny, stream):
    """`text.format` comes back in the response object (and a stream's first event): holding a NaN (Python's
    parser accepts one), it is a 400 before anything runs."""
    content = json.dumps({"model": "tiny", "input": "hi", "max_output_tokens": 1, "stream": stream,
                          "text": {"format": {"type": "text", "x": NaN}}})  # json.dumps writes a bare NaN
    openai_error(httpx.post(tiny + "/v1/responses", content=content, headers={"content-type": "application/json"}))


@pytest.mark.parametrize("name", ["self", "sanitize_control_tokens", "return_assistant_tokens_mask", "tokenize",
                                  "conversations", "raise_exception", "namespace"])
def test_chat_template_kwargs_may_not_set_apply_chat_templates_own_arguments(tiny, name):
    chat = post(tiny, "/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "messages": [HI],
                                              "chat_template_kwargs": {name: 1}})
    assert openai_error(chat)["param"] == f"chat_template_kwargs.{name}"
    responses = post(tiny, "/v1/responses", {"model": "tiny", "max_output_tokens": 1, "input": "hi",
                                             "chat_template_kwargs": {name: 1}})
    assert openai_error(responses)["param"] == f"chat_template_kwargs.{name}"


def test_only_variables_the_template_reads_reach_it(tiny_lm):
    """A kwarg the template reads changes the prompt; any other is left out (as vLLM does), not handed on to
    apply_chat_template, where a later transformers might take it as an argument of its own."""
    import copy
    import dataclasses

    from conftest import ThreadServer

    from app.config import Settings
    from app.main import create_app

    tokenizer = copy.deepcopy(tiny_lm.tokenizer)
    tokenizer.chat_template = "{% if greeting %}{{ greeting }}{% endif %}" + tokenizer.chat_template
    lm = dataclasses.replace(tiny_lm, tokenizer=tokenizer)
    with ThreadServer(create_app(Settings(model="tiny"), lm=lm)) as server:
        def prompt_tokens(kwargs: dict) -> int:
            r = post(server.url, "/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "messages": [HI],
                                                          "chat_template_kwargs": kwargs})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        plain = prompt_tokens({})
        assert prompt_tokens({"greeting": "Hello there, my friend."}) > plain
        assert prompt_tokens({"something_else": "Hello there, my friend."}) == plain


def test_template_variables_are_read_from_the_template():
    from app.models.chat_template import template_variables

    names = template_variables("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
                               "{% if loop.last %}{% break %}{% endif %}{% endfor %}{{ enable_thinking }}")
    assert names == {"messages", "enable_thinking"}
    assert template_variables({"default": "{{ a }}", "tool_use": "{{ b }}"}) == {"a", "b"}
    assert template_variables("{% if %}") is None  # unparsable here: reserved names are still refused


@pytest.mark.parametrize("item, param", [
    ({"type": "reasoning", "content": 5}, "input.0.content"),
    ({"type": "reasoning", "content": [{"text": 5}]}, "input.0.content.0.text"),
    ({"role": "user", "content": [{"type": "input_text", "text": 5}]}, "input.0.content.0.text"),
    ({"role": "user", "content": [{"type": "input_text", "text": ["a"]}]}, "input.0.content.0.text"),
    ({"role": "user", "content": 5}, "input.0.content"),
    ({"role": "robot", "content": "hi"}, "input.0.role"),
    ({"type": "function_call", "call_id": "c1", "name": "f", "arguments": {"a": 1}}, "input.0.arguments"),
    ({"type": "function_call", "name": "f"}, "input.0.call_id"),
    ({"type": "function_call_output", "call_id": "c1", "output": {"a": 1}}, "input.0.output"),
    ("just a string", "input.0"),
])
def test_malformed_responses_input_items_are_400s_naming_the_field(tiny, item, param):
    r = post(tiny, "/v1/responses", {"model": "tiny", "max_output_tokens": 1, "input": [item, HI]})
    assert openai_error(r)["param"] == param


def test_a_text_format_that_is_not_an_object_is_a_400(tiny):
    for fmt, param in (("json", "text.format"), ({"type": "yaml"}, "text.format.type")):
        r = post(tiny, "/v1/responses", {"model": "tiny", "max_output_tokens": 1, "input": "hi",
                                         "text": {"format": fmt}})
        assert openai_error(r)["param"] == param


def test_an_unexpected_error_is_a_500_with_a_bounded_traceback_and_the_connection_kept(tiny, monkeypatch, caplog):
    """What no handler knew: an OpenAI-shaped 500 (Anthropic's on /v1/messages), the traceback logged once and
    bounded (a RecursionError's thousand frames cut to their ends), and the keep-alive connection still open."""
    from app.openai.serving import CompletionServing

    def into_list(value: list) -> None:  # as transformers' conversion does: two frames a level, never one repeated
        into_dict({"a": value})

    def into_dict(value: dict) -> None:
        into_list([value])

    async def broken(self, body, request):
        into_list([])

    monkeypatch.setattr(CompletionServing, "chat", broken)
    with httpx.Client(base_url=tiny, timeout=60) as client, caplog.at_level(logging.INFO):
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [HI]})
        assert r.status_code == 500 and r.json()["error"] == {"message": "internal error: RecursionError",
                                                              "type": "server_error", "param": None, "code": None}
        assert r.headers.get("connection") != "close"
        assert client.get("/v1/models").status_code == 200
    errors = [rec for rec in caplog.records if rec.exc_info]
    assert len(errors) == 1 and errors[0].name == "app", [rec.name for rec in errors]  # not uvicorn's again
    text = LogFormatter().format(errors[0])
    assert len(text) < MAX_TRACEBACK_CHARS + 500 and "frames left out" in text and "RecursionError" in text
    assert "in broken" in text and "in into_list" in text  # where it came from, and where it broke


def test_a_traceback_keeps_both_ends_and_its_cause():
    def deep(n: int):
        if n == 0:
            raise KeyError("x" * 100_000)
        deep(n - 1)

    try:
        try:
            deep(sys.getrecursionlimit() // 2)
        except KeyError as err:
            raise ValueError("the outer one") from err
    except ValueError as err:
        text = bounded_traceback(err)
    assert len(text) < MAX_TRACEBACK_CHARS and text.count("frames left out") == 1
    assert "ValueError: the outer one" in text and "which came from" in text and "KeyError: 'xxx" in text
    assert "characters left out" in text  # the 100,000-character message, cut


def test_a_newline_in_the_path_cannot_forge_an_access_log_line(tiny, caplog):
    def logged() -> list[str]:
        return [rec.getMessage() for rec in caplog.records if rec.name == "app.access" and "nothing" in
                rec.getMessage()]

    with caplog.at_level(logging.INFO, logger="app.access"):
        httpx.get(tiny + "/nothing%0a2026-12-02 10:00:00 INFO app.access: - GET /v1/models 200%0d")
        deadline = time.monotonic() + 5  # the access line is written after the response, off the loop
        while not logged() and time.monotonic() < deadline:
            time.sleep(0.02)
    (line,) = logged()
    assert "\n" not in line and "\r" not in line and "/nothing\\n2026-12-02" in line
    record = logging.LogRecord("x", logging.INFO, "", 0, "user said %s", ("a\nb\x1b[31m",), None)
    assert LogFormatter("%(message)s").format(record) == "user said a\\nb\\x1b[31m"
