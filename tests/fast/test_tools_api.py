"""Tools over HTTP on the tiny model: prompts that show tools and tool turns, the 400s, and the streamed shape."""

from __future__ import annotations

import copy
import json

import httpx
import pytest

from app.core.sequence import TokenEvent
from app.models.loading import LoadedModel
from app.openai.protocol import ChatCompletionRequest
from app.openai.serving import Choice, CompletionServing
from app.openai.stream_parts import tool_payloads
from app.openai.tools import HermesToolParser

from conftest import ThreadServer

CHAT = "/v1/chat/completions"
# A small Hermes-style template in the shape of Qwen2.5's: tools in the system turn (names only: the tiny model's
# context is 256 tokens), calls rendered with tojson.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools>"
    "Answer with <tool_call></tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}"
    '<tool_call>\n{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "22 C, sunny"}]},
]


@pytest.fixture(scope="module")
def hermes_lm(tiny_lm) -> LoadedModel:
    tokenizer = copy.deepcopy(tiny_lm.tokenizer)
    tokenizer.chat_template = HERMES_TEMPLATE
    return LoadedModel(model=tiny_lm.model, tokenizer=tokenizer, name="tiny", max_context=256,
                       eos_ids=tiny_lm.eos_ids, generation_defaults=tiny_lm.generation_defaults)


@pytest.fixture(scope="module")
def hermes_server(hermes_lm):
    from app.config import Settings
    from app.main import create_app

    with ThreadServer(create_app(Settings(model="tiny"), lm=hermes_lm)) as server:
        yield server


def body(**extra):
    return {"model": "tiny", "messages": HISTORY, "tools": [WEATHER], "temperature": 0, "max_tokens": 6, **extra}


def test_history_renders_arguments_as_a_dict_and_tool_turns(hermes_lm):
    request = ChatCompletionRequest(**body())
    text = hermes_lm.tokenizer.apply_chat_template(request.chat_messages(), tools=request.template_tools(),
                                                   tokenize=False, add_generation_prompt=True)
    assert '"arguments": {"city": "Paris"}' in text  # a dict, not a string encoded twice
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in text
    assert "<tools>get_weather </tools>" in text


def test_tools_reach_the_prompt_and_the_answer_is_well_formed(hermes_server):
    short = {"messages": [{"role": "user", "content": "Hi"}]}  # the tiny model's context is 256 tokens
    with_tools = httpx.post(hermes_server.url + CHAT, json=body(**short)).json()
    without = httpx.post(hermes_server.url + CHAT, json=body(tools=None, **short)).json()
    assert with_tools["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"] + 5
    message = with_tools["choices"][0]["message"]
    assert message["role"] == "assistant" and (message["content"] is None or isinstance(message["content"], str))


@pytest.mark.parametrize("extra, param", [
    ({"tools": []}, "tools"),
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [  # deeper than json's stack: was a 500
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
])
def test_bad_tool_requests_get_a_400_naming_the_parameter(hermes_server, extra, param):
    r = httpx.post(hermes_server.url + CHAT, json=body(**extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_template_without_tools_gets_a_400(make_tiny_server):
    server = make_tiny_server()  # the tiny tokenizer's template never mentions tools
    r = httpx.post(server.url + CHAT, json=body())
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "template" in r.json()["error"]["message"]


class _Handle:
    class params:
        logprobs = False


def _run(pieces: list[str], finish: str, lm) -> tuple[Choice, list[dict]]:
    """Token events through the server's own bookkeeping (`_add`), as streamed chunk payloads."""
    serving = object.__new__(CompletionServing)  # only `_add` and the tokenizer are used
    serving.lm = lm
    choice = Choice(0, _Handle(), parser=HermesToolParser(["get_weather"]))
    payloads = []
    for i, piece in enumerate(pieces):
        event = TokenEvent(token_id=i, text=piece, finish_reason=finish if i == len(pieces) - 1 else None)
        delta = serving._add(choice, event)
        if delta.tool_calls:
            payloads += tool_payloads(0, delta, None)
        elif not delta.empty:
            payloads.append({"delta": {"content": delta.content} if delta.content else {},
                             "finish_reason": delta.finish_reason})
    return choice, payloads


def test_streamed_chunks_have_openai_shape_and_match_the_whole_answer(hermes_lm):
    args = {"city": "São Paulo", "note": "</tool_call>"}
    text = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(args) + "}\n</tool_call>"
    choice, payloads = _run([text[i:i + 3] for i in range(0, len(text), 3)], "stop", hermes_lm)
    content = "".join(p["delta"].get("content", "") for p in payloads)
    calls = [c for p in payloads for c in p["delta"].get("tool_calls", [])]
    assert content == "Checking." and "<" not in content
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function" and calls[0]["index"] == 0
    assert calls[0]["function"]["name"] == "get_weather"
    assert all(set(c) == {"index", "function"} for c in calls[1:])
    streamed_args = "".join(c["function"]["arguments"] for c in calls)
    assert payloads[-1]["finish_reason"] == "tool_calls"
    assert json.loads(streamed_args) == args

    whole, _ = _run([text], "stop", hermes_lm)  # the non-streamed answer: one event with all the text
    message = whole.message()
    assert whole.finish_reason == "tool_calls" and message["content"] == "Checking."
    assert message["tool_calls"][0]["function"]["arguments"] == streamed_args


def test_a_call_cut_by_max_tokens_keeps_finish_reason_length(hermes_lm):
    choice, _ = _run(['<tool_call>\n{"name": "get_weather", "arguments": {"ci'], "length", hermes_lm)
    assert choice.finish_reason == "length"


# ---- broken calls over HTTP: a scripted model writes them, the answer is content and the request ends well ----

BROKEN_ANSWERS = [
    '{"name": "f\\q", "arguments": {}}',  # item 6: a bad escape in the name made json.loads raise
    '{"name": "\\u12", "arguments": {}}',
    '{"name": "get_weather", "arguments": {"a": 1,}}',  # item 4: arguments that are not JSON
    "{\"name\": \"get_weather\", \"arguments\": {'a': 1}}",
    '{"name": "get_weather", "arguments": {"a": True}}',
]


def scripted_server(answer_tokens: list[str]) -> ThreadServer:
    """A server whose model greedily writes `answer_tokens` (each one added token) after the generation prompt."""
    from app.config import Settings
    from app.main import create_app
    from tokenizers import AddedToken

    from test_reasoning import qwen3_tokenizer, scripted_lm

    tokenizer = qwen3_tokenizer()
    tokenizer.chat_template = HERMES_TEMPLATE  # Qwen2.5's shape: no thinking to take the answer for
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in answer_tokens])
    lm = scripted_lm(tokenizer, ["\n", *answer_tokens, "<|im_end|>"])
    return ThreadServer(create_app(Settings(model="qwen3-tiny"), lm=lm))


def ask(server: ThreadServer, stream: bool):
    request = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER],
               "temperature": 0, "max_tokens": 12, "stream": stream}
    if not stream:
        return httpx.post(server.url + CHAT, json=request, timeout=30)
    with httpx.stream("POST", server.url + CHAT, json=request, timeout=30) as r:
        return r.status_code, [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.full
@pytest.mark.parametrize("call", BROKEN_ANSWERS)
def test_a_broken_call_comes_back_as_content_streamed_and_not(call):
    tokens = ["<tool_call>", "\n" + call + "\n", "</tool_call>", " Done."]
    text = "".join(tokens)
    with scripted_server(tokens) as server:
        r = ask(server, stream=False)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] == text and "tool_calls" not in choice["message"]
        assert choice["finish_reason"] == "stop"

        status, lines = ask(server, stream=True)
        assert status == 200 and lines[-1] == "[DONE]"
        chunks = [json.loads(line) for line in lines[:-1]]
        assert not any("error" in c for c in chunks)
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("content") or "" for d in deltas) == text
        assert not any("tool_calls" in d for d in deltas)
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_the_scripted_model_does_make_a_call_when_the_json_is_good():  # the control for the test above
    tokens = ["<tool_call>", '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "</tool_call>"]
    with scripted_server(tokens) as server:
        choice = ask(server, stream=False).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


# ---- every family: its template round-trips a tool conversation, and clients read a scripted model's calls ----

from tool_templates import FAMILY_TEMPLATES  # noqa: E402

from app.openai.tools import choose_tool_format, parse_tool_calls, tool_format  # noqa: E402

FAMILY_TEMPLATES = {"hermes": (HERMES_TEMPLATE, "\n", ("<|im_start|>assistant\n", "<|im_end|>")),
                    **FAMILY_TEMPLATES}
CALLED = ("get_weather", {"city": "Paris"})


def family_tokenizer(fmt: str, extra_tokens: list[str] = ()):
    """The tiny Qwen3 tokenizer with the family's template; the generation prompt's end and `extra_tokens` as
    added tokens, so that a scripted model can start from it and write them."""
    from tokenizers import AddedToken

    from test_reasoning import qwen3_tokenizer

    template, prompt_end, _ = FAMILY_TEMPLATES[fmt]
    tokenizer = qwen3_tokenizer()
    tokenizer.chat_template = template
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in (prompt_end, *extra_tokens)
                          if t and t != "\n"])
    return tokenizer


def history(call_id: str, arguments: str) -> list[dict]:
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": call_id, "content": "22 C, sunny"}]


@pytest.mark.parametrize("fmt", list(FAMILY_TEMPLATES))
def test_each_familys_template_is_recognised_and_round_trips_a_tool_conversation(fmt):
    """The parser's call, sent back as history, renders into the family's template; the parser reads the rendered
    call back as the same call, and the tool's result is in the prompt."""
    tokenizer = family_tokenizer(fmt)
    assert tool_format(tokenizer.chat_template) == fmt
    assert choose_tool_format(tokenizer)[0] == fmt
    from tool_families import write

    call = parse_tool_calls(write(fmt, [CALLED]), fmt, ["get_weather"]).tool_calls[0]
    request = ChatCompletionRequest(model="m", messages=history(call["id"], call["function"]["arguments"]),
                                    tools=[WEATHER])
    text = tokenizer.apply_chat_template(request.chat_messages(), tools=request.template_tools(), tokenize=False,
                                         add_generation_prompt=True)
    _, prompt_end, (start, end) = FAMILY_TEMPLATES[fmt]
    assert "22 C, sunny" in text and "get_weather" in text.split("Weather in Paris?")[0]  # tools shown first
    assert text.endswith(prompt_end if fmt != "mistral" else "[/TOOL_RESULTS]")  # Mistral has no generation prompt
    after_user = text.index("Weather in Paris?")
    begin = text.index(start, after_user) + len(start)
    turn = text[begin:text.index(end, begin)]
    again = parse_tool_calls(turn, fmt, ["get_weather"])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in again.tool_calls] == [CALLED]


def test_a_mistral_template_refuses_other_ids_and_takes_the_parsers():
    tokenizer = family_tokenizer("mistral")
    request = ChatCompletionRequest(model="m", messages=history("call_1", '{"city": "Paris"}'), tools=[WEATHER])
    with pytest.raises(Exception, match="length 9"):
        tokenizer.apply_chat_template(request.chat_messages(), tools=request.template_tools(), tokenize=False)


def family_server(fmt: str, answer_tokens: list[str]) -> ThreadServer:
    from app.config import Settings
    from app.main import create_app

    from test_reasoning import scripted_lm

    tokenizer = family_tokenizer(fmt, answer_tokens)
    prompt_end = FAMILY_TEMPLATES[fmt][1]
    lm = scripted_lm(tokenizer, [prompt_end, *answer_tokens, "<|im_end|>"])
    return ThreadServer(create_app(Settings(model="qwen3-tiny"), lm=lm))


def answer_tokens(text: str) -> list[str]:
    """The family's text in three tokens, cut inside the call, so that its markers and arguments arrive split."""
    a, b = len(text) // 3, 2 * len(text) // 3
    return [text[:a], text[a:b], text[b:]]


@pytest.mark.full
@pytest.mark.parametrize("fmt", list(FAMILY_TEMPLATES))
def test_the_openai_sdk_and_langchain_read_each_familys_calls_streamed_and_not(fmt):
    import openai
    from langchain_openai import ChatOpenAI

    from tool_families import write

    text = write(fmt, [CALLED], content="Let me check. ")
    with family_server(fmt, answer_tokens(text)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        ask = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}],
               "tools": [WEATHER], "temperature": 0, "max_tokens": 12}
        whole = client.chat.completions.create(**ask)
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check. "
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CALLED[1]
        if fmt == "mistral":
            assert len(call.id) == 9 and call.id.isalnum()

        content, calls, finish = "", {}, None
        for chunk in client.chat.completions.create(**ask, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert content == "Let me check. " and finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [CALLED]

        # the second turn: the call and its result go back through the family's template
        follow = client.chat.completions.create(**{**ask, "messages": [
            ask["messages"][0], choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "22 C, sunny"}]})
        assert follow.choices[0].finish_reason in ("tool_calls", "stop", "length")

        llm = ChatOpenAI(base_url=server.url + "/v1", api_key="x", model="qwen3-tiny", temperature=0, max_tokens=12,
                         max_retries=0)
        message = llm.bind_tools([WEATHER]).invoke("Weather in Paris?")
        assert [(c["name"], c["args"]) for c in message.tool_calls] == [CALLED]


@pytest.mark.full
def test_the_start_log_names_the_chosen_parser_and_a_setting_forces_another(caplog):
    from app.config import Settings
    from app.main import create_app

    from test_reasoning import scripted_lm
    from tool_families import write

    tokens = answer_tokens(write("mistral", [CALLED]))
    tokenizer = family_tokenizer("hermes", tokens)  # a Hermes template, but the model writes Mistral's calls
    lm = scripted_lm(tokenizer, ["\n", *tokens, "<|im_end|>"])
    ask = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER],
           "temperature": 0, "max_tokens": 12}
    with caplog.at_level("INFO", logger="app.state"):
        with ThreadServer(create_app(Settings(model="qwen3-tiny"), lm=lm)) as server:
            auto = httpx.post(server.url + CHAT, json=ask, timeout=30).json()["choices"][0]
        assert "tool calls: hermes (auto, from the chat template)" in caplog.text
        assert auto["finish_reason"] == "stop" and "[TOOL_CALLS]" in auto["message"]["content"]  # not Hermes: text
        with ThreadServer(create_app(Settings(model="qwen3-tiny", tool_call_parser="mistral"), lm=lm)) as server:
            forced = httpx.post(server.url + CHAT, json=ask, timeout=30).json()["choices"][0]
    assert "tool calls: mistral (TOOL_CALL_PARSER=mistral)" in caplog.text
    assert forced["finish_reason"] == "tool_calls" and forced["message"]["content"] is None
    assert json.loads(forced["message"]["tool_calls"][0]["function"]["arguments"]) == CALLED[1]


@pytest.mark.full
def test_markers_a_tokenizer_marks_special_still_reach_the_parser():
    """Mistral's tokenizers mark `[TOOL_CALLS]` and `[ARGS]` special, and decoding skips special tokens: the choice
    puts them back from their token ids, so `[TOOL_CALLS]name[ARGS]{...}` is still a call, and no marker is content."""
    import openai
    from tokenizers import AddedToken

    from app.config import Settings
    from app.main import create_app
    from test_reasoning import scripted_lm

    arguments = '{"city": "Paris"}'
    answer = ["[TOOL_CALLS]", "get_weather", "[ARGS]", arguments]
    tokenizer = family_tokenizer("mistral", ["get_weather", arguments])
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in ("[TOOL_CALLS]", "[ARGS]")],
                         special_tokens=True)
    assert tokenizer.decode(tokenizer.convert_tokens_to_ids(["[TOOL_CALLS]"]), skip_special_tokens=True) == ""
    lm = scripted_lm(tokenizer, [FAMILY_TEMPLATES["mistral"][1], *answer, "<|im_end|>"])
    with ThreadServer(create_app(Settings(model="qwen3-tiny", tool_call_parser="mistral"), lm=lm)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        ask = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}],
               "tools": [WEATHER], "temperature": 0, "max_tokens": 8}
        choice = client.chat.completions.create(**ask).choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        plain = client.chat.completions.create(**{**ask, "tools": None}).choices[0]  # no tools: markers stay hidden
        assert "[TOOL_CALLS]" not in plain.message.content and "get_weather" in plain.message.content
