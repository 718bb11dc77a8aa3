"""An agent framework against a real `final serve` (issue 80): openai-agents' Agent with a Python function tool,
through its Chat Completions model, on SmolLM2. The run reads the model's call from message.tool_calls, runs the
function, sends the result back as a tool message (content None on the calling turn, tool_call_id on the result) and
gets the model's answer: the whole agent loop over HTTP on 127.0.0.1.

openai-agents installs only on the veRL 0.9 lane: it needs openai >= 1.104 (0.4.x: >= 2.2), and the 0.6.0 lane
holds SGLang 0.5.2's pin openai==1.99.1 (pydantic-ai imports opentelemetry._events, which the opentelemetry-api
both lanes hold no longer has). So this file skips where the package is missing (tests/verl09.txt runs it)."""

from __future__ import annotations

import asyncio

import pytest

agents = pytest.importorskip("agents")

from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,  # noqa: E402
                    set_tracing_disabled)
from openai import AsyncOpenAI  # noqa: E402

from final.inf import InferenceEngine  # noqa: E402
from final.server.app import ServerThread, create_app  # noqa: E402
from tools_helpers import SMOL  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    set_tracing_disabled(True)  # the SDK would export traces to api.openai.com
    inference = InferenceEngine({"model_path": SMOL, "progress": False,
                                 "rollout": {"name": "local", "prompt_length": 1024, "response_length": 48}})
    try:
        with ServerThread(create_app(inference)) as srv:
            yield srv
    finally:
        inference.shutdown()


def _history(city: str) -> list[dict]:
    """The few-shot history of tools_helpers.few_shot as openai-agents input items (Responses format)."""
    items: list[dict] = []
    for i, (done, weather) in enumerate((("Paris", "sunny"), ("Rome", "rainy"))):
        items += [{"role": "user", "content": f"What is the weather in {done}?"},
                  {"type": "function_call", "call_id": f"call_{i}", "name": "get_weather",
                   "arguments": f'{{"city": "{done}"}}'},
                  {"type": "function_call_output", "call_id": f"call_{i}", "output": f"{weather} in {done}"},
                  {"role": "assistant", "content": f"It is {weather} in {done}."}]
    return items + [{"role": "user", "content": f"What is the weather in {city}?"}]


def test_an_agent_calls_a_function_tool_and_answers(server):
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: The city name, e.g. Paris
        """
        asked.append(city)
        return f"foggy in {city}"

    async def run():
        async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600) as client:
            agent = Agent(name="weather", instructions="You answer questions about the weather.", tools=[get_weather],
                          model=OpenAIChatCompletionsModel(model="smollm2", openai_client=client),
                          model_settings=ModelSettings(temperature=0, max_tokens=48))
            return await Runner.run(agent, _history("London"), max_turns=4)

    result = asyncio.run(run())
    assert asked == ["London"]
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert result.new_items[1].output == "foggy in London"
    assert isinstance(result.final_output, str)
