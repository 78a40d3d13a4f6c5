"""An agent framework as the client, end to end: the OpenAI Agents SDK (`openai-agents`) runs
a tool loop against the server (tool_choice "required" on the first turn, the SDK resets it
to auto after the call, the tool's result goes back and the model answers in text), streamed
and not. The SDK is not a project dependency (it pulls mcp, cryptography, PyJWT, websockets and
more); this module skips without it (`pip install openai-agents` to run it)."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from http_stack import openai
from support.serving import ServerThread
from test_http_server import TINY, tiny_engine

agents = pytest.importorskip("agents")


def test_an_agent_runs_a_tool_loop():
    calls: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"], unit: Literal["C", "F"]) -> str:
        """Today's weather in a city."""
        calls.append((city, unit))
        return f"21 {unit} and sunny in {city}"

    async def run(url: str) -> None:
        agents.set_tracing_disabled(True)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        agent = agents.Agent(
            name="weather",
            instructions="Answer with the weather tool.",
            tools=[get_weather],
            model=agents.OpenAIChatCompletionsModel(model=TINY, openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="required", max_tokens=200),
        )
        result = await agents.Runner.run(agent, "Weather in Paris?", max_turns=4)
        assert len(calls) == 1 and isinstance(result.final_output, str)
        kinds = [type(item).__name__ for item in result.new_items]
        assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
        streamed = agents.Runner.run_streamed(agent, "Weather in Oslo?", max_turns=4)
        async for _ in streamed.stream_events():
            pass
        assert len(calls) == 2 and isinstance(streamed.final_output, str)

    with ServerThread(tiny_engine()) as server:
        asyncio.run(run(server.url))
