"""Tool-call parsers: whole text and streamed in every split, with the known traps of peers as cases."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from app.openai.tools import (
    HermesToolParser, JsonToolParser, ToolCallDelta, classify_start, collect, make_parser, parse_tool_calls,
    tool_format,
)

TOOLS = ["get_weather", "get_time", "noop"]


def call(name, args, raw=None):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {raw if raw is not None else json.dumps(args)}}}\n</tool_call>'


def streamed(text, fmt="hermes", pieces=None, parallel=True):
    """Feed `text` in the given split (default: one character at a time) and return everything emitted."""
    parser = make_parser(fmt, TOOLS, parallel)
    out = []
    cuts = pieces if pieces is not None else list(text)
    for piece in cuts:
        out += parser.feed(piece)
    return out + parser.finish()


def args_of(answer):
    return [json.loads(c["function"]["arguments"]) for c in answer.tool_calls]


def test_one_call_with_content_before():
    text = "Let me check.\n" + call("get_weather", {"city": "Paris"})
    answer = parse_tool_calls(text, "hermes", TOOLS)
    assert answer.content == "Let me check.\n"
    assert len(answer.tool_calls) == 1
    c = answer.tool_calls[0]
    assert c["id"].startswith("call_") and len(c["id"]) > 10 and c["type"] == "function"
    assert c["function"]["name"] == "get_weather" and json.loads(c["function"]["arguments"]) == {"city": "Paris"}


def test_no_content_gives_none_and_plain_text_has_no_calls():
    assert parse_tool_calls(call("noop", {}), "hermes", TOOLS).content is None
    plain = parse_tool_calls("Paris is the capital of France.", "hermes", TOOLS)
    assert plain.content == "Paris is the capital of France." and plain.tool_calls == []


def test_empty_arguments_stay_an_empty_object():  # vLLM 28806
    answer = parse_tool_calls(call("noop", {}), "hermes", TOOLS)
    assert answer.tool_calls[0]["function"]["arguments"] == "{}"
    deltas = [d for d in streamed(call("noop", {})) if isinstance(d, ToolCallDelta)]
    assert "".join(d.arguments for d in deltas) == "{}"


def test_literal_close_tag_inside_an_argument_string():  # vLLM 45167
    args = {"code": 'print("</tool_call>")', "note": "a } and a \" quote"}
    text = call("get_weather", args) + "\n" + call("get_time", {"tz": "UTC"})
    answer = parse_tool_calls(text, "hermes", TOOLS)
    assert args_of(answer) == [args, {"tz": "UTC"}]
    assert [c["function"] for c in collect(streamed(text)).tool_calls] == [c["function"] for c in answer.tool_calls]


def test_unicode_arguments_and_names_kept_verbatim():
    args = {"city": "北京", "emoji": "🌧️", "accent": "café"}
    answer = parse_tool_calls(call("get_weather", args, raw=json.dumps(args, ensure_ascii=False)), "hermes", TOOLS)
    assert args_of(answer) == [args]
    assert "北京" in answer.tool_calls[0]["function"]["arguments"]


def test_several_calls_get_their_own_index_and_id():  # Ollama 15457: all index 0, no call_ prefix
    text = call("get_weather", {"city": "Paris"}) + "\n" + call("get_time", {"tz": "CET"})
    items = streamed(text)
    firsts = [d for d in items if isinstance(d, ToolCallDelta) and d.id]
    assert [d.index for d in firsts] == [0, 1] and [d.name for d in firsts] == ["get_weather", "get_time"]
    assert len({d.id for d in firsts}) == 2 and all(d.id.startswith("call_") for d in firsts)


def test_parallel_false_keeps_only_the_first_call():
    text = call("get_weather", {"city": "Paris"}) + "\n" + call("get_time", {"tz": "CET"})
    answer = parse_tool_calls(text, "hermes", TOOLS, parallel=False)
    assert [c["function"]["name"] for c in answer.tool_calls] == ["get_weather"]
    assert collect(streamed(text, parallel=False)).tool_calls[0]["function"]["name"] == "get_weather"


def test_streamed_arguments_keep_their_closing_braces():  # vLLM 22885
    args = {"q": "x", "filter": {"range": {"from": 1, "to": [2, 3]}}}
    items = streamed(call("get_weather", args))
    joined = "".join(d.arguments for d in items if isinstance(d, ToolCallDelta))
    assert json.loads(joined) == args and joined.endswith("]}}}")


def test_a_call_goes_out_whole_once_its_json_is_known_good():  # a streamed call cannot be taken back
    text = call("get_weather", {"city": "Paris", "days": 3})
    parser = HermesToolParser(TOOLS)
    seen = []
    for ch in text[:-1]:
        seen += parser.feed(ch)
    assert seen == []  # nothing of the call before its closing tag: it could still turn out to be no call
    first, args = parser.feed(text[-1])
    assert first.name == "get_weather" and first.id.startswith("call_") and json.loads(args.arguments) == {
        "city": "Paris", "days": 3}


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_split_streams_the_same_answer_as_the_whole_text(data):  # vLLM 21544: partial JSON at every cut
    text = data.draw(st.sampled_from([
        "Sure, checking.\n" + call("get_weather", {"city": "São Paulo", "note": "</tool_call> {[\"x"}),
        call("noop", {}) + "\n" + call("get_time", {"tz": "UTC"}),
        "no calls here, just < and <tool and text",
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '```json\n{"name": "get_time", "arguments": {}}\n```',
        "<function=get_weather>{\"city\": \"Rome\"}</function>",
        '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>',
        "<tool_call>\nnot json at all\n</tool_call>",
    ]))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=12))))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    whole = parse_tool_calls(text, "hermes", TOOLS)
    items = streamed(text, pieces=pieces)
    got = collect(items)
    assert got.content == whole.content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got.tool_calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]
    content = "".join(i for i in items if isinstance(i, str))
    if whole.tool_calls:
        assert "<tool_call" not in content and "<tool_" not in content  # neither the tag nor its start leaks


def test_tag_start_is_held_back_then_released_when_it_is_not_a_tag():
    parser = HermesToolParser(TOOLS)
    assert parser.feed("a <tool") == ["a "]
    assert parser.feed("box> b") == ["<toolbox> b"]


def test_coder_habits_bare_json_fence_list_and_function_tag():  # Ollama 13519, vLLM 21571
    for text in ('{"name": "get_weather", "arguments": {"city": "Paris"}}',
                 '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
                 '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                 '<function=get_weather>{"city": "Paris"}</function>',
                 '{"name": "get_weather", "parameters": {"city": "Paris"}}'):
        for fmt in ("hermes", "json") if not text.startswith("<") else ("hermes",):
            answer = parse_tool_calls(text, fmt, TOOLS)
            assert answer.content is None and args_of(answer) == [{"city": "Paris"}], (fmt, text)


def test_json_that_is_not_a_call_stays_content():
    for text in ('{"city": "Paris"}', '{"name": "unknown_tool", "arguments": {}}', "```python\nprint(1)\n```"):
        answer = parse_tool_calls(text, "hermes", TOOLS)
        assert answer.content == text and answer.tool_calls == []


def test_code_fence_that_is_not_json_streams_at_once():
    parser = JsonToolParser(TOOLS)
    assert parser.feed("```js") == []  # could still be ```json
    assert parser.feed("x") == ["```jsx"]  # cannot: no need to wait for the end of the line
    assert parser.feed("\nx = 1") == ["\nx = 1"]


def test_classify_start():
    assert classify_start("  ") is None and classify_start(" {") == "json" and classify_start("Hi") == "text"
    assert classify_start("``") is None and classify_start("```json\n") is None and classify_start("```\n{") == "json"


def test_unclosed_call_at_the_end_still_parses():
    answer = parse_tool_calls('<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}', "hermes", TOOLS)
    assert args_of(answer) == [{"tz": "UTC"}]


def test_broken_call_becomes_content():
    text = "<tool_call>\nnot json\n</tool_call>"
    assert parse_tool_calls(text, "hermes", TOOLS).content == text


@pytest.mark.parametrize("template, fmt", [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    ("{% if tools %}{{ tools | tojson }}{% endif %}<tool_call>", "hermes"),
    ("{% if tools %}{{ tools | tojson }}{% endif %}", "json"),
    ({"default": "x", "tool_use": "{{ tools }} <tool_call>"}, "hermes"),
    (None, None),
])
def test_tool_format_is_read_from_the_template(template, fmt):
    assert tool_format(template) == fmt


def test_wire_shapes():
    first = ToolCallDelta(0, id="call_x", name="f").wire()
    assert first == {"index": 0, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": ""}}
    assert ToolCallDelta(1, '{"a"').wire() == {"index": 1, "function": {"arguments": '{"a"'}}
