"""Real clients against a real server on the default model (Qwen2.5-Coder-0.5B), as a new user would point them:
the official `anthropic` SDK on /v1/messages (create, stream, system, stop_sequences, a tool round trip,
count_tokens, a missing max_tokens), pydantic-ai's agents through its Anthropic provider (a function tool, a
structured output type), and instructor through the openai SDK (TOOLS and JSON_SCHEMA modes). The session's shared
real server, with an API key (the Anthropic clients send it as `x-api-key`, the openai SDK as a Bearer token); greedy,
short answers."""

from __future__ import annotations

import anthropic
import pytest
from pydantic import BaseModel, Field

from test_server_real import API_KEY, MODEL

pytestmark = [pytest.mark.real_model, pytest.mark.server]

GREEDY = {"temperature": 0}  # today's SDK sends no temperature: it travels in extra_body
PARIS = [{"role": "user", "content": "Which city is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                            "required": ["city"]}}


class Capital(BaseModel):  # "city", not "name": with `name` the 0.5B model fills in the country's name
    city: str = Field(description="the capital city")
    country: str


@pytest.fixture(scope="module")
def server(shared_real_server):
    return shared_real_server  # the session's real server (tests/conftest.py), with API_KEY


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=300)


def test_sdk_create_stream_system_stop_sequences_and_count(client):
    system = "Answer with the city's name only."
    message = client.messages.create(model=MODEL, max_tokens=10, system=system, messages=PARIS, extra_body=GREEDY)
    assert message.stop_reason == "end_turn" and message.content[0].type == "text"
    assert "Paris" in message.content[0].text
    with client.messages.stream(model=MODEL, max_tokens=10, system=system, messages=PARIS,
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == message.content[0].text
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: read from the prefix cache
    count = client.messages.count_tokens(model=MODEL, system=system, messages=PARIS)
    assert count.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens

    counting = [{"role": "user", "content": "Count from 1 to 9, separated by commas."}]
    cut = client.messages.create(model=MODEL, max_tokens=30, messages=counting, stop_sequences=["5"],
                                 extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "5"
    assert "4" in cut.content[0].text and "5" not in cut.content[0].text

    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model=MODEL, max_tokens=anthropic.omit, messages=PARIS, timeout=60)


def test_sdk_tool_use_then_tool_result(client):
    ask = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    first = client.messages.create(model=MODEL, max_tokens=40, tools=[WEATHER], messages=ask, extra_body=GREEDY)
    assert first.stop_reason == "tool_use", first
    call = next(block for block in first.content if block.type == "tool_use")
    assert call.name == "get_weather" and call.id.startswith("toolu_") and "paris" in call.input["city"].lower()

    history = ask + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": "22 degrees Celsius, sunny"}]}]
    final = client.messages.create(model=MODEL, max_tokens=40, tools=[WEATHER], messages=history,
                                   tool_choice={"type": "none"}, extra_body=GREEDY)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens + 20  # the call and its result are in it
    assert [b.type for b in final.content] == ["text"] and final.content[0].text.strip()


def anthropic_model(server):
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    return AnthropicModel(MODEL, provider=AnthropicProvider(base_url=server.url, api_key=API_KEY))


def test_pydantic_ai_agent_with_a_function_tool(server):
    from pydantic_ai import Agent

    cities: list[str] = []
    agent = Agent(anthropic_model(server), model_settings={"max_tokens": 60, "temperature": 0})

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return "22 degrees Celsius, sunny"

    result = agent.run_sync("What is the weather like in Paris right now?")
    assert cities and "paris" in cities[0].lower()
    assert isinstance(result.output, str) and result.output.strip()


def test_pydantic_ai_agent_with_a_structured_output_type(server):
    from pydantic_ai import Agent

    agent = Agent(anthropic_model(server), output_type=Capital, model_settings={"max_tokens": 60, "temperature": 0})
    capital = agent.run_sync("Which city is the capital of France?").output
    assert isinstance(capital, Capital) and capital.city == "Paris" and capital.country == "France"


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_extraction(server, mode):
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300),
                                    mode=getattr(instructor.Mode, mode))
    capital = client.chat.completions.create(model=MODEL, response_model=Capital, messages=PARIS, max_tokens=40,
                                             temperature=0, max_retries=0)
    assert isinstance(capital, Capital) and capital.city == "Paris" and capital.country == "France"
