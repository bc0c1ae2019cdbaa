"""The ``openai`` Agents SDK, a client no one here wrote, running an agent with a function tool
against a real ``loom serve`` through its Chat Completions model: the SDK sends the tools, Loom
enforces the call (``tool_choice="required"``), the SDK parses it, runs the Python function with
the arguments, and either stops on its result or sends the result back for the model's answer.

Oracles: the arguments the function receives validate against the schema the SDK derived from
its signature; the answer after the tool result is the one Loom gives the same history (the
user's question, the call, the tool's result) sent by the plain ``openai`` client.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from loom.testing.templates import HERMES_TEMPLATE
from tests.test_server import Server
from tests.test_tool_calling import MODEL

agents = pytest.importorskip("agents")

pytestmark = pytest.mark.slow

INSTRUCTIONS = "Answer with the weather tool."
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "hermes.jinja"
    path.write_text(HERMES_TEMPLATE)
    s = Server("--chat-template", str(path))
    yield s
    s.stop()


def _weather_tool(calls: list):
    @agents.function_tool
    def get_weather(city: str, unit: str) -> str:
        """The weather in a city.

        Args:
            city: the city's name.
            unit: celsius or fahrenheit.
        """
        calls.append({"city": city, "unit": unit})
        return f"Sunny, 21 degrees {unit} in {city}."

    return get_weather


async def _run_agent(url: str, behavior: str):
    from openai import AsyncOpenAI

    calls: list[dict] = []
    tool = _weather_tool(calls)
    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
        agent = agents.Agent(
            name="weather",
            instructions=INSTRUCTIONS,
            model=agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
            tools=[tool],
            model_settings=agents.ModelSettings(
                tool_choice="required", temperature=0, max_tokens=48
            ),
            tool_use_behavior=behavior,
        )
        result = await agents.Runner.run(agent, QUESTION, max_turns=3)
    return result, calls, tool


@pytest.fixture(autouse=True)
def _no_tracing():
    # the SDK exports traces to OpenAI's platform unless told not to
    agents.set_tracing_disabled(True)


def test_agent_calls_the_tool_and_stops_on_its_result(server):
    result, calls, tool = asyncio.run(_run_agent(server.url, "stop_on_first_tool"))
    assert len(calls) == 1
    jsonschema.validate(calls[0], tool.params_json_schema)
    assert result.final_output == f"Sunny, 21 degrees {calls[0]['unit']} in {calls[0]['city']}."
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem"]


def test_agent_sends_the_result_back_for_the_answer(server):
    from openai import OpenAI

    result, calls, tool = asyncio.run(_run_agent(server.url, "run_llm_again"))
    assert calls, "the tool ran"
    jsonschema.validate(calls[0], tool.params_json_schema)
    # (at temperature 0 the model answers in words after the result: the SDK's turns end)
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    # The same history through the plain client: the answer must be the agent's.
    call = result.new_items[0].raw_item
    tools = [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.params_json_schema,
            },
        }
    ]
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": result.new_items[1].output},
    ]
    assert json.loads(call.arguments) == calls[0]
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    want = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, temperature=0, max_tokens=48
    )
    assert want.choices[0].message.content
    assert result.final_output == want.choices[0].message.content
