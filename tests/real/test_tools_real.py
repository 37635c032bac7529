"""Real clients against a real server on the default model (Qwen2.5-Coder-0.5B): the openai SDK's tools round trip
(streamed and not) and `chat.completions.parse`, LangChain's `bind_tools` with a forced tool and
`with_structured_output`. The session's shared real server; greedy, short answers."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI
from pydantic import BaseModel

from test_server_real import API_KEY, MODEL

pytestmark = [pytest.mark.real_model, pytest.mark.server]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def tools_server(shared_real_server):
    return shared_real_server  # the session's real server (tests/conftest.py), with API_KEY


@pytest.fixture(scope="module")
def client(tools_server) -> OpenAI:
    return OpenAI(base_url=f"{tools_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def test_openai_sdk_tools_round_trip_streamed_and_not(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=40)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()

    # streamed: the same greedy answer, as delta.tool_calls chunks
    calls: dict[int, dict] = {}
    finish_reason, content = None, ""
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0,
                                                max_tokens=40, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for t in delta.tool_calls or []:
            entry = calls.setdefault(t.index, {"id": t.id, "name": t.function.name, "arguments": ""})
            entry["arguments"] += t.function.arguments or ""
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    assert finish_reason == "tool_calls" and "<tool_call" not in content
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert calls[0]["arguments"] == call.function.arguments  # fragments join to the non-streamed arguments

    # the round trip: the call and its result go back (rendered by the template), the model answers in words
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "22 degrees Celsius, sunny"}]
    final = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=40)
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + 20  # the call and its result are in the prompt
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_openai_sdk_parse_with_a_pydantic_model(client):
    parsed = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        response_format=City, temperature=0, max_tokens=40)
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and city.name == "Paris" and city.country == "France"


def test_langchain_bind_tools_with_a_forced_tool_and_with_structured_output(tools_server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "sunny"

    llm = ChatOpenAI(base_url=f"{tools_server.url}/v1", api_key=API_KEY, model=MODEL, temperature=0,
                     max_tokens=40, max_retries=0, timeout=300)
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Is it raining in Rome?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"]["city"], str)

    city = llm.with_structured_output(City).invoke("Which city is the capital of France?")
    assert isinstance(city, City) and city.name == "Paris"


def test_agents_sdk_runs_an_agent_with_a_function_tool(tools_server):
    """The OpenAI Agents SDK over the Responses API: the model calls the tool, the SDK runs it and sends the result
    back as a function_call_output item, and the model answers."""
    import asyncio

    import openai
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)  # tracing would try to upload to OpenAI
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 C in {city}."

    client = openai.AsyncOpenAI(base_url=tools_server.url + "/v1", api_key=API_KEY)
    agent = Agent(name="weather", instructions="You answer weather questions. Always call get_weather first.",
                  tools=[get_weather], model=OpenAIResponsesModel(MODEL, client),
                  model_settings=ModelSettings(temperature=0, max_tokens=48))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    kinds = [type(item) for item in result.new_items]
    assert calls == ["Paris"]
    assert kinds[:3] == [ToolCallItem, ToolCallOutputItem, MessageOutputItem], kinds
    assert isinstance(result.final_output, str) and result.final_output.strip()
