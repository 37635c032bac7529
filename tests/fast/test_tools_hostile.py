"""Tool-call parsing of broken and hostile model output: a call is only a call when its JSON is valid, the parser
never raises, and its work is linear in the output."""

from __future__ import annotations

import json
import sys

import pytest
from hypothesis import given, settings, strategies as st

from app.openai.tools import ToolCallDelta, collect, make_parser, parse_tool_calls

TOOLS = ["get_weather", "get_time", "write_file"]
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def wrapped(body: str) -> str:
    return f"{OPEN}\n{body}\n{CLOSE}"


def feed(text: str, pieces: list[str] | None = None, fmt: str = "hermes", parallel: bool = True) -> list:
    parser = make_parser(fmt, TOOLS, parallel)
    out = []
    for piece in pieces if pieces is not None else list(text):
        out += parser.feed(piece)
    return out + parser.finish()


# Arguments that are not a JSON object, and names that do not decode: the model wrote text, not a call.
BROKEN = [
    wrapped('{"name": "get_weather", "arguments": {"a": 1,}}'),  # trailing comma
    wrapped("{\"name\": \"get_weather\", \"arguments\": {'a': 1}}"),  # single quotes
    wrapped('{"name": "get_weather", "arguments": {"a": True}}'),  # Python's True
    wrapped('{"name": "get_weather", "arguments": {"a": NaN}}'),  # not JSON, though Python's json reads it
    '<tool_call>\n{"name": "get_weather", "arguments": {"a": 1\n</tool_call>\nDone.',  # never closes
    wrapped('{"name": "get_weather", "arguments": [1, 2]}'),  # not an object
    wrapped('{"name": "get_weather", "arguments": "{\\"a\\": 1"}'),  # a string that is no object
    wrapped('{"name": "get_weather", "arguments": {"a": 1}}}'),  # one brace too many
    wrapped('{"name": "f\\q", "arguments": {}}'),  # bad escape in the name (item 6)
    wrapped('{"name": "\\u12", "arguments": {}}'),  # short \u escape in the name
    wrapped('{"name": "get_weather", "arguments": {"a": "\\q"}}'),  # bad escape in an argument
    wrapped('{"name": "get_weather", "arguments": {"a": "line\nbreak"}}'),  # raw control character in a string
    wrapped('{"name": "get_weather", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"),  # deeper than json's stack
    '<tool_call>\n{"name": "get_weather", "arguments": {"a": "never closed}\n</tool_call>\nDone.',
    "Checking.\n" + wrapped('{"name": "get_weather", "arguments": {"a": 1,}}') + "\nDone.",
]


@pytest.mark.parametrize("text", BROKEN)
def test_a_call_with_broken_json_stays_content_whole_and_streamed(text):
    whole = parse_tool_calls(text, "hermes", TOOLS)
    assert whole.tool_calls == [] and whole.content == text
    items = feed(text)  # one character at a time: nothing may go out as a call before the JSON is known good
    assert not any(isinstance(i, ToolCallDelta) for i in items)
    assert "".join(items) == text


def test_a_broken_call_after_a_good_one_is_dropped_and_a_good_one_after_a_broken_one_counts():
    good = wrapped('{"name": "get_time", "arguments": {"tz": "UTC"}}')
    bad = wrapped('{"name": "get_weather", "arguments": {"a": 1,}}')
    after = parse_tool_calls(good + "\n" + bad, "hermes", TOOLS)
    assert after.content is None and [c["function"]["name"] for c in after.tool_calls] == ["get_time"]
    before = parse_tool_calls(bad + "\n" + good, "hermes", TOOLS)
    assert before.content == bad + "\n" and [c["function"]["arguments"] for c in before.tool_calls] == ['{"tz": "UTC"}']


def test_arguments_are_the_models_own_text_and_a_string_object_is_decoded():
    raw = '{"n": 1.10, "big": 12345678901234567890, "s":"a\\u00e9"}'
    answer = parse_tool_calls(wrapped('{"name": "get_time", "arguments": ' + raw + "}"), "hermes", TOOLS)
    assert answer.tool_calls[0]["function"]["arguments"] == raw  # not re-encoded: 1.10 stays 1.10
    encoded = wrapped('{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}')
    assert json.loads(parse_tool_calls(encoded, "hermes", TOOLS).tool_calls[0]["function"]["arguments"]) == {"tz": "UTC"}


def test_json_habit_and_function_tag_never_raise_on_deep_or_bad_text():
    for text in ("[" * 5000 + "]" * 5000, '{"name": "get_weather", "arguments": ' + "[" * 5000 + "]" * 5000 + "}",
                 "<function=get_weather>" + "[" * 5000 + "]" * 5000 + "</function>",
                 '<function=get_weather>{"a": "\\q"}</function>', "```json\n{\"name\": \"f\\q\"}\n```"):
        for fmt in ("hermes", "json"):
            assert parse_tool_calls(text, fmt, TOOLS) == collect(feed(text, fmt=fmt))
            assert collect(feed(text, fmt=fmt)).content == text


# ---- every split gives the whole text's answer, and nothing raises ----

VALID = [
    wrapped('{"name": "get_weather", "arguments": {"city": "Paris", "note": "</tool_call> {[\\"x"}}'),
    "Sure.\n" + wrapped('{"name": "get_time", "arguments": {}}') + "\n" + wrapped('{"name": "noop_not_offered"}'),
    wrapped('{"arguments": {"tz": "UTC"}, "name": "get_time"}'),
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}',  # unclosed tag at the end: still a call
]
FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "<function=get_time>", "</function>", "```json\n", "```",
             '{"name": "get_time", ', '"arguments": ', "{", "}", "[", "]", '"', "\\", "\\q", "\\u12", "\\u00e9",
             "True", "'", ",", ":", " ", "\n", "1", '"tz"', "x", "é", "NaN"]


def assert_split_invariant(text: str, cuts: list[int], fmt: str = "hermes") -> None:
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    whole = parse_tool_calls(text, fmt, TOOLS)
    got = collect(feed(text, pieces, fmt))
    assert got.content == whole.content
    assert [c["function"] for c in got.tool_calls] == [c["function"] for c in whole.tool_calls]
    for c in whole.tool_calls:
        assert isinstance(json.loads(c["function"]["arguments"]), dict)  # only valid objects are ever calls


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_valid_and_broken_calls_split_anywhere_give_the_whole_texts_answer(data):
    text = data.draw(st.sampled_from(VALID + [t for t in BROKEN if len(t) < 1000]))  # not the deep one: slow
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=16))))
    assert_split_invariant(text, cuts)
    if text in VALID:
        assert parse_tool_calls(text, "hermes", TOOLS).tool_calls


@pytest.mark.full
@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=30), st.data(), st.sampled_from(["hermes", "json"]))
def test_random_call_shaped_text_never_raises_and_splits_consistently(fragments, data, fmt):
    text = "".join(fragments)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=12))))
    assert_split_invariant(text, cuts, fmt)


# ---- linear work ----

def write_file_call(size: int) -> str:
    content = ("def f(x):\n    return {\"x\": [x, '</tool_call>']}\n" * (size // 40 + 1))[:size]
    return wrapped(json.dumps({"name": "write_file", "arguments": {"path": "a.py", "content": content}}))


def lines_run(text: str, budget: int, fmt: str = "hermes") -> int:
    """Python lines the parser runs to take `text` in 4-character tokens: a count of work that does not depend on
    the machine's speed. Stops counting (and returns) once over `budget`."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    parser = make_parser(fmt, TOOLS)
    sys.settrace(lambda frame, event, arg: tracer if "app/openai/tools" in frame.f_code.co_filename else None)
    try:
        for i in range(0, len(text), 4):
            parser.feed(text[i:i + 4])
            if count > budget:
                break
        parser.finish()
    finally:
        sys.settrace(None)
    return count


@pytest.mark.parametrize("fmt", ["hermes", "json"])
def test_parsing_work_grows_linearly_with_the_call(fmt):
    small = write_file_call(2_000)
    big = write_file_call(20_000)
    if fmt == "json":
        small, big = small[len(OPEN) + 1: -len(CLOSE) - 1], big[len(OPEN) + 1: -len(CLOSE) - 1]  # the bare habit
    work_small = lines_run(small, budget=10**7, fmt=fmt)
    work_big = lines_run(big, budget=30 * work_small, fmt=fmt)
    assert work_big <= 15 * work_small, (work_small, work_big)  # linear: ~10x; rescanning the body: ~100x
    assert parse_tool_calls(big, fmt, TOOLS).tool_calls[0]["function"]["name"] == "write_file"


# ---- every family: broken text stays content, random marker soup splits consistently, linear work ----

from tool_families import FAMILIES, SCHEMAS, broken, parser_name, write  # noqa: E402

FAMILY_TOOLS = list(SCHEMAS)
FAMILY_FRAGMENTS = FRAGMENTS + [
    "<|python_tag|>", "<|python_start|>", "<|python_end|>", "get_weather(", ")", "=", "[TOOL_CALLS]", "[ARGS]",
    "get_weather", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>", "function", "<|tool_call|>", "<|/tool_call|>", "functools[", "<function=get_time>",
    "<parameter=tz>", "</parameter>", "<|start|>assistant", "<|channel|>commentary to=functions.get_time ",
    "<|channel|>final", "<|constrain|>json", "<|message|>", "<|call|>", "<|", "[TOOL", "<｜tool",
]


def family_feed(text: str, pieces: list[str], fmt: str) -> list:
    parser = make_parser(parser_name(fmt), FAMILY_TOOLS, True, SCHEMAS)
    out = []
    for piece in pieces:
        out += parser.feed(piece)
    return out + parser.finish()


@pytest.mark.parametrize("fmt", FAMILIES)
def test_each_familys_broken_and_deep_calls_never_raise_and_stay_content(fmt):
    deep = write(fmt, [("get_weather", '{"city": ' + "[" * 5000 + "]" * 5000 + "}")])
    if parser_name(fmt) == "pythonic":
        deep = write(fmt, [("get_weather", "city=" + "[" * 5000 + "]" * 5000)])
    for text in (broken(fmt), deep, "Checking.\n" + broken(fmt) + "\nDone."):
        whole = parse_tool_calls(text, parser_name(fmt), FAMILY_TOOLS, schemas=SCHEMAS)
        assert whole.tool_calls == [] and whole.content == text
        items = family_feed(text, list(text) if len(text) < 1000 else [text[:7], text[7:]], fmt)
        assert not any(isinstance(i, ToolCallDelta) for i in items) and "".join(items) == text


@pytest.mark.full
@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(FAMILY_FRAGMENTS), max_size=30), st.data(), st.sampled_from(FAMILIES))
def test_random_marker_soup_never_raises_and_splits_consistently_in_every_family(fragments, data, fmt):
    text = "".join(fragments)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=12))))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    whole = parse_tool_calls(text, parser_name(fmt), FAMILY_TOOLS, schemas=SCHEMAS)
    got = collect(family_feed(text, pieces, fmt))
    assert got.content == whole.content
    assert [c["function"] for c in got.tool_calls] == [c["function"] for c in whole.tool_calls]
    for c in whole.tool_calls:
        assert isinstance(json.loads(c["function"]["arguments"]), dict)


def family_write_file(fmt: str, size: int) -> str:
    content = ("def f(x):\n    return {\"x\": [x, 'y']}\n" * (size // 36 + 1))[:size]
    return write(fmt, [("write_file", {"path": "a.py", "content": content})])


@pytest.mark.parametrize("fmt", [f for f in FAMILIES if f != "hermes"])
def test_each_familys_parsing_work_grows_linearly_with_the_call(fmt, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "TOOLS", FAMILY_TOOLS)  # lines_run's parser offers write_file
    small, big = family_write_file(fmt, 2_000), family_write_file(fmt, 20_000)
    work_small = lines_run(small, budget=10**7, fmt=parser_name(fmt))
    work_big = lines_run(big, budget=30 * work_small, fmt=parser_name(fmt))
    assert work_big <= 15 * work_small, (work_small, work_big)
    answer = parse_tool_calls(big, parser_name(fmt), FAMILY_TOOLS, schemas=SCHEMAS)
    assert json.loads(answer.tool_calls[0]["function"]["arguments"])["content"].startswith("def f(x):")
