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


# ---- every family's format: the same suite as Hermes, on text written as that family writes it ----

from tool_families import FAMILIES, MARKERS, SCHEMAS, broken, parser_name, write  # noqa: E402

FAMILY_TOOLS = ["get_weather", "get_time", "noop", "write_file"]
TWO_CALLS = [("get_weather", {"city": "São Paulo", "days": 3, "note": 'a } and a " quote, 北京'}),
             ("get_time", {"tz": "UTC"})]


def family_stream(text, fmt, pieces, parallel=True):
    parser = make_parser(parser_name(fmt), FAMILY_TOOLS, parallel, SCHEMAS)
    out = []
    for piece in pieces:
        out += parser.feed(piece)
    return out + parser.finish()


def family_whole(text, fmt, parallel=True):
    return parse_tool_calls(text, parser_name(fmt), FAMILY_TOOLS, parallel, SCHEMAS)


def functions(answer):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answer.tool_calls]


@pytest.mark.parametrize("fmt", FAMILIES)
def test_each_family_reads_its_calls_after_content(fmt):
    answer = family_whole(write(fmt, TWO_CALLS, content="Let me check.\n"), fmt)
    assert answer.content == "Let me check.\n"
    assert functions(answer) == TWO_CALLS
    bare = family_whole(write(fmt, TWO_CALLS[:1]), fmt)
    assert bare.content is None and functions(bare) == TWO_CALLS[:1]


@pytest.mark.parametrize("fmt", FAMILIES)
def test_each_family_streams_the_whole_answer_at_every_byte_boundary(fmt):
    text = write(fmt, TWO_CALLS, content="Checking.\n")
    whole = family_whole(text, fmt)
    marker = MARKERS[parser_name(fmt)]
    for pieces in [list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]:
        items = family_stream(text, fmt, pieces)
        got = collect(items)
        assert got.content == whole.content == "Checking.\n", pieces
        assert [c["function"] for c in got.tool_calls] == [c["function"] for c in whole.tool_calls], pieces
        content = "".join(i for i in items if isinstance(i, str))
        assert marker[:2] not in content and "<|" not in content and "[TOOL" not in content, pieces


@pytest.mark.parametrize("fmt", FAMILIES)
def test_each_family_gives_parallel_calls_their_own_index_and_id(fmt):
    items = family_stream("", fmt, [write(fmt, TWO_CALLS)])
    firsts = [d for d in items if isinstance(d, ToolCallDelta) and d.id]
    assert [d.index for d in firsts] == [0, 1] and [d.name for d in firsts] == ["get_weather", "get_time"]
    assert len({d.id for d in firsts}) == 2
    if parser_name(fmt) == "mistral":  # Mistral's templates and API refuse any other id
        assert all(len(d.id) == 9 and d.id.isalnum() and d.id.isascii() for d in firsts)
    else:
        assert all(d.id.startswith("call_") for d in firsts)
    single = family_whole(write(fmt, TWO_CALLS), fmt, parallel=False)
    assert functions(single) == TWO_CALLS[:1]


@pytest.mark.parametrize("fmt", FAMILIES)
def test_each_familys_broken_or_unknown_call_stays_content_whole_and_streamed(fmt):
    for text in (broken(fmt), write(fmt, [("not_offered", {"a": 1})])):
        whole = family_whole(text, fmt)
        assert whole.tool_calls == [] and whole.content == text
        items = family_stream(text, fmt, list(text))
        assert not any(isinstance(i, ToolCallDelta) for i in items) and "".join(items) == text


@pytest.mark.parametrize("fmt", FAMILIES)
def test_each_familys_plain_text_streams_as_it_comes(fmt):
    parser = make_parser(parser_name(fmt), FAMILY_TOOLS)
    assert parser.feed("Paris is ") == ["Paris is "]
    assert parser.feed("sunny.") == ["sunny."]
    assert parser.finish() == []


def test_pythonic_calls_are_read_as_literals_never_evaluated():
    for text in ('[get_weather(city=__import__("os").system("echo hi"))]', "[get_weather(city=open('x'))]",
                 "[get_weather(city={1, 2})]", "[get_weather(days=1e999)]", "[get_weather(**{'city': 'x'})]",
                 "[get_weather('Paris')]", "[" * 500 + "]" * 500):
        answer = parse_tool_calls(text, "pythonic", FAMILY_TOOLS)
        assert answer.tool_calls == [] and answer.content == text, text
    answer = parse_tool_calls("[get_weather(city='Paris', days=None, note=True)]", "pythonic", FAMILY_TOOLS)
    assert functions(answer) == [("get_weather", {"city": "Paris", "days": None, "note": True})]


def test_qwen3_coder_values_are_typed_by_the_tools_schema():
    schemas = {"f": {"properties": {"n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"},
                                    "tags": {"type": "array"}, "opts": {"type": "object"}, "s": {"type": "string"},
                                    "bad": {"type": "integer"}}}}
    params = {"n": "42", "x": "1.5", "ok": "True", "tags": '["a", "b"]', "opts": '{"k": 1}', "s": "  007\nline",
              "bad": "many", "free": "12"}
    text = write("qwen3_coder", [("f", "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items()))])
    answer = parse_tool_calls(text, "qwen3_coder", ["f"], schemas=schemas)
    assert json.loads(answer.tool_calls[0]["function"]["arguments"]) == {
        "n": 42, "x": 1.5, "ok": True, "tags": ["a", "b"], "opts": {"k": 1}, "s": "  007\nline",
        "bad": "many", "free": "12"}  # a value that is not its type, or has no schema, stays the model's text


def test_harmony_text_outside_commentary_calls_stays_content():
    final = "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
    preamble = "<|channel|>commentary<|message|>Checking the weather.<|end|>"
    for text in (final, preamble, "<|channel|>" + "x" * 400):
        assert parse_tool_calls(text, "harmony", FAMILY_TOOLS) == collect(family_stream(text, "harmony", list(text)))
        assert parse_tool_calls(text, "harmony", FAMILY_TOOLS).content == text
    parser = make_parser("harmony", FAMILY_TOOLS)
    shown = parser.feed("<|channel|>final<|message|>It is")  # decided at <|message|>: not held to the end
    assert "".join(shown) == "<|channel|>final<|message|>It is"
    call = '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"tz": "UTC"}<|call|>'
    recipient_first = '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "UTC"}'
    for text in (preamble + call, recipient_first):
        answer = parse_tool_calls(text, "harmony", FAMILY_TOOLS)
        assert functions(answer) == [("get_time", {"tz": "UTC"})]
    assert parse_tool_calls(preamble + call, "harmony", FAMILY_TOOLS).content == preamble


@pytest.mark.parametrize("template, specials, fmt", [
    ("{{ tools }}<|start|>assistant<|channel|>commentary to=functions.x", (), "harmony"),
    ("{{ tools }}<｜tool▁calls▁begin｜>", (), "deepseek_v3"),
    ("{{ tools }}<tool_call>\n<function=x>\n<parameter=p>", (), "qwen3_coder"),
    ("{{ tools }}[AVAILABLE_TOOLS]", (), "mistral"),
    ("{{ tools }}<|tool|>{{ t }}<|/tool|>", (), "phi4_mini"),
    ("{{ tools }}<|start_of_role|>available_tools", (), "granite"),
    ("{{ tools }}[func_name1(params_name1=params_value1)]", (), "pythonic"),
    ("{{ tools }}<|start_header_id|>ipython<|end_header_id|>", (), "llama3_json"),
    ("{{ tools }}", ("[TOOL_CALLS]",), "mistral"),  # only the tokenizer's special tokens tell it
    ("{{ tools }}", (), "json"),
])
def test_each_family_is_read_from_its_template_or_special_tokens(template, specials, fmt):
    assert tool_format(template, specials) == fmt


def test_tool_call_parser_setting_lists_the_parsers_and_refuses_others():
    import typing

    from app.config import Settings
    from app.openai.tools import PARSERS, choose_tool_format

    allowed = typing.get_args(Settings.model_fields["tool_call_parser"].annotation)
    assert set(allowed) == {"auto", *PARSERS}
    with pytest.raises(ValueError, match="harmony"):  # the start refuses an unknown name, listing the names
        Settings(tool_call_parser="llama4")

    class Tok:
        chat_template = "{{ tools }}<tool_call>"

        def get_added_vocab(self):
            return {}

    assert choose_tool_format(Tok(), "auto") == ("hermes", "auto, from the chat template")
    assert choose_tool_format(Tok(), "mistral") == ("mistral", "TOOL_CALL_PARSER=mistral")


# ---- forced calls: each format's grammar takes exactly its own calls, and the parser reads what it takes ----

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMAS["get_weather"]}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": SCHEMAS["get_time"]}}
DS = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>"
FORCED = {  # two calls, as each format's forced grammar spells them
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                   '{"name": "get_time", "parameters": {"tz": "UTC"}}',
    "pythonic": '[get_weather(city="Paris", days=2), get_time(tz="UTC")]',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
               '{"name": "get_time", "arguments": {"tz": "UTC"}}]',
    "deepseek_v3": f'<｜tool▁calls▁begin｜>{DS}get_weather\n```json\n{{"city": "Paris"}}\n```<｜tool▁call▁end｜>\n'
                   f'{DS}get_time\n```json\n{{"tz": "UTC"}}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
               '{"name": "get_time", "arguments": {"tz": "UTC"}}]',
    "phi4_mini": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                 '{"name": "get_time", "arguments": {"tz": "UTC"}}]<|/tool_call|>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
                   "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n"
                   "</parameter>\n</function>\n</tool_call>",
    "harmony": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
}


@pytest.mark.parametrize("fmt", list(FORCED))
def test_each_formats_forced_grammar_takes_its_calls_and_nothing_else(fmt):
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from app.structured.schema_check import GrammarLimits
    from app.openai.structured import forced_tool_tag
    from app.openai.tools.wire import Tool

    tools = [Tool(**WEATHER_TOOL), Tool(**TIME_TOOL)]
    grammar = xgr.Grammar.from_structural_tag(json.dumps(forced_tool_tag(fmt, tools, True, GrammarLimits())))
    text = FORCED[fmt]
    assert accepts(grammar, text)
    assert not accepts(grammar, "Sure. " + text) and not accepts(grammar, text[:-1])
    answer = parse_tool_calls(text, fmt, FAMILY_TOOLS, schemas=SCHEMAS)
    assert answer.content is None and functions(answer)[0][0] == "get_weather"
    assert len(answer.tool_calls) == (1 if fmt == "harmony" else 2)
    if fmt != "harmony":  # parallel_tool_calls=false: one call only
        single = xgr.Grammar.from_structural_tag(json.dumps(forced_tool_tag(fmt, tools, False, GrammarLimits())))
        assert not accepts(single, text)
    # city is a string in the schema, days an integer (Qwen3-Coder's values are text: any text is a string)
    wrong = text.replace('"Paris"', "42") if fmt != "qwen3_coder" else text.replace("\n2\n", "\ntwo\n")
    assert not accepts(grammar, wrong) or fmt == "pythonic"  # pythonic checks names and literals, not types


@pytest.mark.parametrize("fmt", ["mistral:list", "granite", "phi4_mini"])
def test_a_list_of_calls_whose_special_marker_decoding_skipped_is_still_read(fmt):
    marked = write(fmt, TWO_CALLS)
    bare = marked[marked.index("["):].removesuffix("<|/tool_call|>").replace("[TOOL_CALLS] ", "")
    assert bare.startswith("[{")
    assert functions(family_whole(bare, fmt)) == TWO_CALLS
    streamed = collect(family_stream(bare, fmt, list(bare)))
    assert [c["function"] for c in streamed.tool_calls] == [c["function"] for c in family_whole(bare, fmt).tool_calls]
    assert family_whole("[1] is a citation, not a call.", fmt).content == "[1] is a citation, not a call."
