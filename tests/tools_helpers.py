"""Shared pieces for the tool-calling tests (the Python API, `final serve`, the fuzz, the notebook's checks).

- `get_weather` / `add`: Python tool functions (type hints and Google docstrings: their schemas come from
  transformers.utils.get_json_schema).
- `few_shot(city)`: a conversation in which the assistant has called get_weather twice before (a calling turn with
  content None, its tool result, the answer): SmolLM2-135M then calls get_weather for `city` at greedy, in the hermes
  format of the fallback prompt, so the tests read real calls from the real model without a constraint.
- `make_thinking_model(src, dst)`: the tiny random model with `<think>` / `</think>` as tokens and a
  Qwen3-thinking-style chat template: the generation prompt opens `<think>\\n` (the output starts inside the
  reasoning) unless `enable_thinking` is false, which closes an empty block first (Qwen3's own rule).
"""

from __future__ import annotations

import json
from pathlib import Path

from multiturn_helpers import QWEN25_TEMPLATE, renamed_model

SMOL = "builtin:smollm2-135m-instruct"


def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: The city name, e.g. Paris
    """
    return f"sunny and 21 degrees in {city}"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number
        b: The second number
    """
    return a + b


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}},
                   "required": ["city"]}}}


def _call(city: str, i: int) -> dict:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


def few_shot(city: str = "London") -> list[dict]:
    """Two earlier get_weather calls and their results, then the question about `city`."""
    return [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [_call("Paris", 1)]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny in Paris"},
            {"role": "assistant", "content": "It is sunny in Paris."},
            {"role": "user", "content": "What is the weather in Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [_call("Rome", 2)]},
            {"role": "tool", "tool_call_id": "call_2", "content": "rainy in Rome"},
            {"role": "assistant", "content": "It is rainy in Rome."},
            {"role": "user", "content": f"What is the weather in {city}?"}]


QWEN3_THINKING_TEMPLATE = QWEN25_TEMPLATE.replace(
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}",
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- else %}\n        {{- '<think>\\n' }}\n    {%- endif %}\n"
    "{%- endif %}")
assert QWEN3_THINKING_TEMPLATE != QWEN25_TEMPLATE


def make_thinking_model(src: str, dst: Path) -> str:
    """The tiny model as a thinking model (see the module doc): <think> and </think> are tokens, the tool tags text
    (the hermes format: a Qwen-style <tool_call> token meets test_tools_generate's xfail)."""
    return renamed_model(src, dst, {13: ("<think>", False), 14: ("</think>", False)}, QWEN3_THINKING_TEMPLATE)
