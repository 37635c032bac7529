"""The Responses API (`POST /v1/responses`) over a real socket: shapes, the event stream, errors, and real clients.

Most tests run on the tiny random model (answers are noise, shapes are not) and on the tiny scripted Qwen3 of
test_reasoning.py (a known answer with known thinking). The Agents SDK runs against a live server on the default
model in tests/real/test_tools_real.py.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import ThreadServer
from test_reasoning import THINKS, THINKS_FOREVER, THINKS_THEN_CALLS, WEATHER_TOOL, _app, qwen3_tokenizer, scripted_lm

from app.openai.responses.protocol import ResponsesRequest

QUESTION = "Which city is the capital of France?"
FLAT_TOOL = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's flat shape


@pytest.fixture(scope="module")
def thinker():
    with ThreadServer(_app(scripted_lm(qwen3_tokenizer(), THINKS))) as server:
        yield server


def post(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json={"model": server.model, **body}, timeout=30)


def events(server, **body) -> list[tuple[str, dict]]:
    """(SSE event name, payload) pairs, plus ("[DONE]", {}) if the stream ends with it."""
    out, name = [], None
    with httpx.stream("POST", server.url + "/v1/responses", timeout=30,
                      json={"model": server.model, "stream": True, **body}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = line[len("data: "):]
                out.append(("[DONE]", {}) if data == "[DONE]" else (name, json.loads(data)))
    return out


@pytest.fixture
def tiny(make_tiny_server):
    server = make_tiny_server()
    server.model = "tiny"
    return server


@pytest.fixture(autouse=True)
def _name_thinker(thinker):
    thinker.model = "qwen3-tiny"


def test_text_answer_equals_chat_completions(tiny):
    """One path underneath: the same request through both APIs gives the same text and token counts."""
    r = post(tiny, input=QUESTION, instructions="Answer briefly.", temperature=0, max_output_tokens=12,
             ignore_eos=True)
    assert r.status_code == 200, r.text
    resp = r.json()
    chat = httpx.post(tiny.url + "/v1/chat/completions", json={
        "model": "tiny", "temperature": 0, "max_tokens": 12, "ignore_eos": True,
        "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]}).json()
    assert resp["id"].startswith("resp_") and resp["object"] == "response" and resp["model"] == "tiny"
    (message,) = resp["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["id"].startswith("msg_")
    assert message["content"][0]["type"] == "output_text"
    assert message["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert resp["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert resp["usage"]["output_tokens"] == 12 == chat["usage"]["completion_tokens"]
    assert resp["usage"]["total_tokens"] == resp["usage"]["input_tokens"] + 12
    # cut off by max_output_tokens, as OpenAI reports it
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["store"] is False and resp["instructions"] == "Answer briefly."


def test_stream_events_in_order(tiny):
    stream = events(tiny, input=[{"type": "message", "role": "user",
                                  "content": [{"type": "input_text", "text": QUESTION}]}],
                    temperature=0, max_output_tokens=10, ignore_eos=True)
    names = [name for name, _ in stream]
    assert names[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"], "no [DONE] after a finished response, as OpenAI"
    assert set(names[4:-4]) == {"response.output_text.delta"}
    payloads = [p for _, p in stream]
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    assert all(p["type"] == name for name, p in stream)
    final = payloads[-1]["response"]
    text = "".join(p["delta"] for p in payloads if p["type"] == "response.output_text.delta")
    assert text == final["output"][0]["content"][0]["text"] == payloads[-4]["text"]
    whole = post(tiny, input=QUESTION, temperature=0, max_output_tokens=10, ignore_eos=True).json()
    assert text == whole["output"][0]["content"][0]["text"]
    # the same conversation a second time: its prompt now comes from the prefix cache, and usage says so
    cached = [u.pop("input_tokens_details")["cached_tokens"] for u in (final["usage"], whole["usage"])]
    assert final["usage"] == whole["usage"] and cached[0] == 0 < cached[1] < whole["usage"]["input_tokens"]


def test_reasoning_items(thinker):
    resp = post(thinker, input=QUESTION, temperature=0).json()
    assert resp["status"] == "completed"
    reasoning, message = resp["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "The Paris is"}]
    assert message["content"][0]["text"] == "Paris"
    # <think> The Paris is </think> are thinking; \n\n Par is <|im_end|> the answer
    assert resp["usage"]["output_tokens"] == 9 and resp["usage"]["output_tokens_details"]["reasoning_tokens"] == 5
    stream = events(thinker, input=QUESTION, temperature=0)
    kinds = [p["type"] for _, p in stream]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(p.get("delta", "") for _, p in stream if p["type"] == "response.reasoning_text.delta") \
        == "The Paris is"
    assert kinds[-1] == "response.completed"
    final = stream[-1][1]["response"]["output"]
    assert [(i["type"], i["status"], i["content"]) for i in final] == \
        [(i["type"], i["status"], i["content"]) for i in resp["output"]]
    off = post(thinker, input=QUESTION, temperature=0, chat_template_kwargs={"enable_thinking": False}).json()
    assert [item["type"] for item in off["output"]] == ["message"]


def test_reasoning_effort_caps_the_thinking():
    with ThreadServer(_app(scripted_lm(qwen3_tokenizer(), THINKS_FOREVER))) as server:
        server.model = "qwen3-tiny"
        endless = post(server, input=QUESTION, temperature=0, max_output_tokens=20).json()
        assert endless["status"] == "incomplete" and [i["type"] for i in endless["output"]] == ["reasoning"]
        assert endless["output"][0]["status"] == "incomplete"
        capped = post(server, input=QUESTION, temperature=0, max_output_tokens=40,
                      reasoning={"effort": "minimal"}).json()
        assert capped["status"] == "completed" and [i["type"] for i in capped["output"]] == ["message"]
        assert capped["output"][0]["content"][0]["text"] == "Paris"


def test_openai_sdk_create_and_stream(thinker):
    client = openai.OpenAI(base_url=thinker.url + "/v1", api_key="unused")
    resp = client.responses.create(model="qwen3-tiny", input=QUESTION, temperature=0)
    assert resp.output_text == "Paris" and resp.status == "completed"
    assert resp.output[0].type == "reasoning" and resp.output[0].content[0].text == "The Paris is"
    assert resp.usage.input_tokens > 0 and resp.usage.output_tokens == 9
    with client.responses.stream(model="qwen3-tiny", input=QUESTION, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Paris"
    assert [item.type for item in final.output] == ["reasoning", "message"]


@pytest.mark.full
def test_text_format_after_the_thinking_and_sdk_parse(thinker):
    """text.format json_schema runs through chat's grammar, after </think>; the SDK parses it into a pydantic model."""
    from typing import Literal

    from pydantic import BaseModel

    class City(BaseModel):
        city: Literal["Paris"]

    client = openai.OpenAI(base_url=thinker.url + "/v1", api_key="unused")
    parsed = client.responses.parse(model="qwen3-tiny", input=QUESTION, temperature=0, max_output_tokens=60,
                                    text_format=City)
    assert parsed.output_parsed == City(city="Paris") and parsed.status == "completed"
    assert parsed.output[0].type == "reasoning" and parsed.output[0].content[0].text == "The Paris is"


def test_input_items_become_the_conversation():
    """Items map onto chat messages: instructions first, earlier answers (with their thinking) as assistant turns."""
    body = ResponsesRequest(model="m", instructions="Be brief.", input=[
        {"role": "user", "content": "Hi"},  # the SDK's short form: no "type"
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "greet"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"type": "message", "role": "developer", "content": "Stay calm."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Bye"}]}])
    assert body.to_chat_request().chat_messages() == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
        {"role": "system", "content": "Stay calm."}, {"role": "user", "content": "Bye"}]


@pytest.fixture(scope="module")
def caller():
    with ThreadServer(_app(scripted_lm(qwen3_tokenizer(), THINKS_THEN_CALLS))) as server:
        server.model = "qwen3-tiny"
        yield server


def test_function_call_items(caller):
    resp = post(caller, input="Weather in Paris?", tools=[FLAT_TOOL], temperature=0).json()
    assert resp["status"] == "completed"
    reasoning, call = resp["output"]
    assert reasoning["type"] == "reasoning" and call["type"] == "function_call" and call["id"].startswith("fc_")
    assert call["call_id"].startswith("call_") and call["name"] == "get_weather" and call["status"] == "completed"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    stream = events(caller, input="Weather in Paris?", tools=[FLAT_TOOL], temperature=0)
    kinds = [p["type"] for _, p in stream]
    at = kinds.index("response.function_call_arguments.done")
    assert kinds[at - 1] == "response.function_call_arguments.delta" and kinds[at + 1] == "response.output_item.done"
    added = [p for _, p in stream if p["type"] == "response.output_item.added"][-1]
    assert added["item"]["type"] == "function_call" and added["item"]["name"] == "get_weather"
    assert added["item"]["arguments"] == ""
    arguments = "".join(p["delta"] for _, p in stream if p["type"] == "response.function_call_arguments.delta")
    assert arguments == stream[at][1]["arguments"] and json.loads(arguments) == {"city": "Paris"}
    assert kinds[-1] == "response.completed"
    # the SDK's stream helper checks that items keep their identity from added to done to completed
    client = openai.OpenAI(base_url=caller.url + "/v1", api_key="unused")
    with client.responses.stream(model="qwen3-tiny", input="Weather?", tools=[FLAT_TOOL], temperature=0) as s:
        final = s.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert final.output[1].name == "get_weather"


def test_tool_round_trip_input(caller):
    """The call and its output come back as input items: an assistant turn with tool_calls, then a tool turn."""
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"}]
    chat = ResponsesRequest(model="m", input=items, tools=[FLAT_TOOL]).to_chat_request()
    assert chat.chat_messages()[1:] == [
        {"role": "assistant", "content": "", "reasoning_content": "t",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "call_1"}]
    assert chat.tools[0].function.name == "get_weather"
    r = post(caller, input=items, tools=[FLAT_TOOL], tool_choice="auto", temperature=0)
    assert r.status_code == 200 and r.json()["status"] == "completed", r.text


@pytest.mark.full
@pytest.mark.parametrize("extra, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input.0.content.0.image_url"),  # the tiny model reads text only
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
    ({"input": []}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # the tiny model does not think
    ({"model": "other"}, "model"),
])
def test_clear_400s(tiny, extra, param):
    r = post(tiny, **{"input": "hi", **extra})
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"], error


def test_failure_mid_stream_sends_error_event_then_done(tiny, monkeypatch):
    import app.core.engine.step as step_module

    calls = {"n": 0}
    real = step_module.run_pass

    def flaky(model, work, *n_out):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device failure")
        return real(model, work, *n_out)

    monkeypatch.setattr(step_module, "run_pass", flaky)
    stream = events(tiny, input="hi", max_output_tokens=10, ignore_eos=True)
    assert stream[-1][0] == "[DONE]"
    name, error = stream[-2]
    assert name == "error" and "simulated device failure" in error["message"]
    assert error["sequence_number"] == stream[-3][1]["sequence_number"] + 1
    # counted as the error it ended with, not as a 200, and not as a client cancellation
    metrics = httpx.get(tiny.url + "/metrics").text
    assert 'status="500"} 1.0' in metrics and "simple_serve_cancellations_total 0.0" in metrics
