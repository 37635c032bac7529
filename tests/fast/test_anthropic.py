"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over a real socket: shapes, the event
stream, Anthropic-shaped errors, auth, and the official `anthropic` SDK.

Most tests run on the tiny random model (answers are noise, shapes are not), the thinking and tool tests on the
tiny scripted Qwen3 of test_reasoning.py (known thinking, a known call). tests/real/test_anthropic_real.py runs the real
clients against the default model.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from conftest import ThreadServer
from test_reasoning import THINKS_THEN_CALLS, _app, qwen3_tokenizer, scripted_lm

from app.anthropic.protocol import MessagesRequest

MESSAGES = "/v1/messages"
QUESTION = "Which city is the capital of France?"
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def body(**extra):
    return {"model": "tiny", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": QUESTION}], **extra}


def events(url: str, payload: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """(SSE event name, payload) pairs, in order."""
    out, name = [], None
    with httpx.stream("POST", url + MESSAGES, json={**payload, "stream": True}, headers=headers, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[len("data: "):])))
    return out


@pytest.fixture
def tiny(make_tiny_server):
    return make_tiny_server()


@pytest.fixture(scope="module")
def caller():
    with ThreadServer(_app(scripted_lm(qwen3_tokenizer(), THINKS_THEN_CALLS))) as server:
        yield server


def test_text_answer_equals_chat_completions_and_cache_reads_count(tiny):
    """One path underneath: the same request through both APIs gives the same text and token counts."""
    first = httpx.post(tiny.url + MESSAGES, json=body(system="Answer briefly.")).json()
    chat = httpx.post(tiny.url + "/v1/chat/completions", json={
        "model": "tiny", "temperature": 0, "max_tokens": 12, "ignore_eos": True,
        "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]}).json()
    assert first["id"].startswith("msg_") and first["type"] == "message" and first["role"] == "assistant"
    assert first["model"] == "tiny" and first["stop_reason"] == "max_tokens" and first["stop_sequence"] is None
    assert first["content"] == [{"type": "text", "text": chat["choices"][0]["message"]["content"]}]
    usage = first["usage"]
    assert usage["output_tokens"] == 12
    # Anthropic's split of the prompt: computed + read from the prefix cache (the chat request warmed it)
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == chat["usage"]["prompt_tokens"]
    again = httpx.post(tiny.url + MESSAGES, json=body(system=[{"type": "text", "text": "Answer briefly."}])).json()
    assert again["content"] == first["content"]
    assert again["usage"]["cache_read_input_tokens"] > 0
    assert again["usage"]["input_tokens"] + again["usage"]["cache_read_input_tokens"] == \
        chat["usage"]["prompt_tokens"]


def test_stream_events_in_documented_order(tiny):
    stream = events(tiny.url, body())
    names = [name for name, _ in stream]
    assert names[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert all(payload["type"] == name for name, payload in stream)
    start = stream[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert stream[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [p["delta"] for _, p in stream[2:-3]]
    assert all(d["type"] == "text_delta" and d["text"] for d in deltas), "never an empty delta"
    final = stream[-2][1]
    assert final["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    whole = httpx.post(tiny.url + MESSAGES, json=body()).json()
    assert "".join(d["text"] for d in deltas) == whole["content"][0]["text"]
    assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"] == 12


def test_stop_sequence_is_reported(tiny):
    text = httpx.post(tiny.url + MESSAGES, json=body()).json()["content"][0]["text"]
    stop = text[4:6]
    cut = httpx.post(tiny.url + MESSAGES, json=body(stop_sequences=[stop, "never-written"])).json()
    assert cut["stop_reason"] == "stop_sequence" and cut["stop_sequence"] == stop
    assert "".join(b["text"] for b in cut["content"]) == text[:text.index(stop)]


def test_pings_while_waiting(tiny, monkeypatch):
    import app.anthropic.serving as serving

    deltas = serving.CompletionServing.deltas

    async def apart(self, choices):  # 20 ms between tokens, however fast a step or however late the loop
        async for item in deltas(self, choices):
            await asyncio.sleep(0.02)
            yield item

    monkeypatch.setattr(serving.CompletionServing, "deltas", apart)
    monkeypatch.setattr(serving, "PING_S", 0.005)  # every wait for the next token is "long"
    stream = events(tiny.url, body())
    names = [name for name, _ in stream]
    assert "ping" in names and names[0] == "message_start" and names[-1] == "message_stop"
    assert [p for n, p in stream if n == "ping"][0] == {"type": "ping"}


def test_count_tokens_is_the_prompt_a_message_gets(tiny):
    request = body(system="Be brief.")
    count = httpx.post(tiny.url + MESSAGES + "/count_tokens", json={
        k: request[k] for k in ("model", "system", "messages")}).json()
    answer = httpx.post(tiny.url + MESSAGES, json=request).json()["usage"]
    assert count == {"input_tokens": answer["input_tokens"] + answer["cache_read_input_tokens"]}


def test_thinking_and_tool_use_blocks(caller):
    request = {"model": "qwen3-tiny", "max_tokens": 40, "temperature": 0, "tools": [WEATHER],
               "thinking": {"type": "enabled", "budget_tokens": 30},
               "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    whole = httpx.post(caller.url + MESSAGES, json=request).json()
    thinking, call = whole["content"]
    assert thinking == {"type": "thinking", "thinking": "The Paris is", "signature": ""}
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_") and call["name"] == "get_weather"
    assert call["input"] == {"city": "Paris"} and whole["stop_reason"] == "tool_use"
    stream = events(caller.url, request)
    kinds = [(n, p.get("content_block", p.get("delta", {})).get("type")) for n, p in stream]
    assert kinds[1:4] == [("content_block_start", "thinking"), ("content_block_delta", "thinking_delta"),
                          ("content_block_delta", "thinking_delta")]
    start = [p for n, p in stream if n == "content_block_start"][1]
    assert start["index"] == 1 and start["content_block"]["type"] == "tool_use" and start["content_block"]["input"] == {}
    partial = [p["delta"]["partial_json"] for n, p in stream if n == "content_block_delta" and p["index"] == 1]
    assert partial and all(partial) and json.loads("".join(partial)) == {"city": "Paris"}
    assert stream[-2][1]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.full
def test_sdk_thinking_and_tool_round_trip(caller):
    import anthropic  # here, not at the top: the SDK takes seconds to import, and every worker collects this file

    client = anthropic.Anthropic(base_url=caller.url, api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    thinking = {"type": "enabled", "budget_tokens": 30}
    first = client.messages.create(model="qwen3-tiny", max_tokens=40, tools=[WEATHER], messages=ask,
                                   thinking=thinking, extra_body={"temperature": 0})
    assert [block.type for block in first.content] == ["thinking", "tool_use"]
    call = first.content[-1]
    assert first.stop_reason == "tool_use" and call.input == {"city": "Paris"}
    history = ask + [{"role": "assistant", "content": [c.model_dump() for c in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": [{"type": "text", "text": "22 C, sunny"}]}]}]
    count = client.messages.count_tokens(model="qwen3-tiny", tools=[WEATHER], messages=history)
    assert count.input_tokens > client.messages.count_tokens(model="qwen3-tiny", tools=[WEATHER],
                                                              messages=ask).input_tokens + 5
    with client.messages.stream(model="qwen3-tiny", max_tokens=40, tools=[WEATHER], messages=history,
                                thinking=thinking, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.content[-1].type == "tool_use" and final.content[-1].input == {"city": "Paris"}


def test_messages_become_the_chat_conversation():
    # Claude Code's billing header (a per-request hash) is left out, so prompts keep a common prefix
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=3f2a;"},
              {"type": "text", "text": "Be brief."}]
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "system": system, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "ask the tool", "signature": "x"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"c": "P"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                      "content": [{"type": "text", "text": "timeout"}]},
                                     {"type": "text", "text": "And tomorrow?"}]}]})
    chat = request.to_chat_request(reasons=True)
    assert chat.chat_messages() == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "ask the tool",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "w", "arguments": {"c": "P"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: timeout", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "And tomorrow?"}]
    assert chat.max_completion_tokens == 5 and chat.template_kwargs() == {"enable_thinking": False}


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    payload = r.json()
    assert payload["type"] == "error" and set(payload) == {"type", "error"}
    assert payload["error"]["type"] == kind and isinstance(payload["error"]["message"], str)
    return payload["error"]["message"]


def test_errors_are_anthropic_shaped(make_tiny_server):
    server = make_tiny_server(api_key="s3cret", max_request_bytes=4096)
    key = {"x-api-key": "s3cret"}
    url = server.url + MESSAGES
    anthropic_error(httpx.post(url, json=body()), 401, "authentication_error")
    anthropic_error(httpx.post(url, json=body(), headers={"x-api-key": "wrong"}), 401, "authentication_error")
    assert httpx.post(url, json=body(), headers={"authorization": "Bearer s3cret"}).status_code == 200
    no_max = {k: v for k, v in body().items() if k != "max_tokens"}
    assert "max_tokens" in anthropic_error(httpx.post(url, json=no_max, headers=key), 400, "invalid_request_error")
    image = body(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "text", "text": "What is this?"}]}])
    assert "text only" in anthropic_error(httpx.post(url, json=image, headers=key), 400, "invalid_request_error")
    anthropic_error(httpx.post(url, json=body(model="claude-sonnet-4-5"), headers=key), 404, "not_found_error")
    anthropic_error(httpx.post(url, content=b"{not json", headers=key), 400, "invalid_request_error")
    anthropic_error(httpx.post(url, json=body(max_tokens=100_000), headers=key), 400, "invalid_request_error")
    server_tool = body(tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert "server tools" in anthropic_error(httpx.post(url, json=server_tool, headers=key), 400,
                                             "invalid_request_error")
    anthropic_error(httpx.post(url, json=body(system="x" * 5000), headers=key), 413, "request_too_large")
    anthropic_error(httpx.post(url + "/batches", json=body(), headers=key), 404, "not_found_error")
    # the OpenAI routes keep OpenAI's shape
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": []}, headers=key)
    assert r.status_code == 400 and set(r.json()) == {"error"}
    server.state.start_drain()
    anthropic_error(httpx.post(url, json=body(), headers=key), 529, "overloaded_error")


def test_failure_mid_stream_is_an_error_event(make_tiny_server, monkeypatch):
    import app.core.engine.step as step_module

    server = make_tiny_server()
    calls = {"n": 0}
    real = step_module.run_pass

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device failure")
        return real(*args)

    monkeypatch.setattr(step_module, "run_pass", flaky)
    stream = events(server.url, body())
    assert stream[0][0] == "message_start" and stream[-1][0] == "error"
    assert "message_stop" not in [name for name, _ in stream]
    error = stream[-1][1]
    assert error["type"] == "error" and "simulated device failure" in error["error"]["message"]


def test_sdk_create_stream_count_and_missing_max_tokens(tiny):
    import anthropic

    client = anthropic.Anthropic(base_url=tiny.url, api_key="unused", max_retries=0)
    extra = {"ignore_eos": True, "temperature": 0}  # today's SDK sends no temperature: it travels in extra_body
    message = client.messages.create(model="tiny", max_tokens=10, system="Be brief.",
                                     messages=[{"role": "user", "content": QUESTION}], extra_body=extra)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 10
    with client.messages.stream(model="tiny", max_tokens=10, system="Be brief.",
                                messages=[{"role": "user", "content": QUESTION}], extra_body=extra) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == message.content[0].text
    assert final.usage.output_tokens == 10 and final.usage.cache_read_input_tokens > 0
    count = client.messages.count_tokens(model="tiny", system="Be brief.",
                                         messages=[{"role": "user", "content": QUESTION}])
    assert count.input_tokens == final.usage.input_tokens + final.usage.cache_read_input_tokens
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model="tiny", max_tokens=anthropic.omit, timeout=30,  # (the SDK's own default
                               messages=[{"role": "user", "content": QUESTION}])  # timeout needs max_tokens)


def test_a_last_assistant_turn_is_continued(tiny):
    """Anthropic's prefill: the answer continues the last assistant text instead of starting a new turn."""
    prefill = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "The capital is"}]
    count = httpx.post(tiny.url + MESSAGES + "/count_tokens", json={"model": "tiny", "messages": prefill}).json()
    text = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\nThe capital is"
    expected = httpx.post(tiny.url + "/tokenize", json={"prompt": text}).json()["count"]
    assert count == {"input_tokens": expected}
    answer = httpx.post(tiny.url + MESSAGES, json=body(messages=prefill)).json()
    assert answer["stop_reason"] == "max_tokens" and answer["content"][0]["type"] == "text"
