"""Tools from Python, per call (issue 80): `generate(..., tools=[python_function])` on SmolLM2, both modes - calls
parsed and returned (GenerationOutput.tool_calls, OpenAI's shape) and calls run in the multi-turn loop (max_turns,
the guarded executor, on_event) - the typed errors of malformed tool requests, and thinking models'
chat_template_kwargs and reasoning split (a tiny model with a Qwen3-thinking template)."""

from __future__ import annotations

import json

import pytest

from final.errors import PromptError, ToolsError, UnsupportedError
from final.inf import InferenceEngine
from final.models import resolve_model_path
from tools_helpers import SMOL, WEATHER_TOOL, add, few_shot, get_weather, make_thinking_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol():
    with InferenceEngine({"model_path": SMOL, "progress": False,
                          "rollout": {"name": "local", "prompt_length": 1024, "response_length": 64}}) as engine:
        yield engine


def test_calls_come_back_parsed_in_openai_shape(smol):
    out = smol.generate([few_shot("London"), "Say hello."], tools=[get_weather], temperature=0)
    [call] = out.tool_calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "London"}
    assert out.completions[0] == "" and out.metadata[0]["finish_reason"] == "tool_calls"
    assert out.metadata[0]["message"]["content"] is None
    assert out.tool_calls[1] == [] and out.metadata[1]["finish_reason"] in ("stop", "length")
    assert out.completions[1] == out.metadata[1]["message"]["content"]
    # the same call as a dict tool: the same prompt, the same answer (a schema is all a parsed call needs)
    again = smol.generate(few_shot("London"), tools=[WEATHER_TOOL], temperature=0)
    assert again.tool_calls[0][0]["function"] == call["function"]


def test_tool_choice_none_renders_tools_and_parses_nothing(smol):
    """vLLM's rule: the tools are in the prompt, the output is text."""
    out = smol.generate(few_shot("London"), tools=[get_weather], tool_choice="none", temperature=0)
    assert out.tool_calls == [[]] and out.completions[0].startswith("<tool_call>")
    assert out.metadata[0]["finish_reason"] == "stop"


def test_max_turns_runs_the_function_and_goes_on(smol):
    events, ran = [], []

    def get_weather_logged(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: The city name, e.g. Paris
        """
        ran.append(city)
        return get_weather(city)

    get_weather_logged.__name__ = "get_weather"
    out = smol.generate(few_shot("London"), tools=[get_weather_logged, add], max_turns=2, temperature=0,
                        on_event=events.append)
    assert ran == ["London"]
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["assistant", "tool_call", "tool_result"] and kinds[-1] == "done"
    call, result = events[1], events[2]
    assert (call["name"], call["arguments"], call["error"]) == ("get_weather", {"city": "London"}, None)
    assert result["response"] == "sunny and 21 degrees in London"
    meta = out.metadata[0]
    assert kinds.count("assistant") == 2 and [c["name"] for c in meta["tool_calls"]] == ["get_weather"]
    roles = [m["role"] for m in meta["messages"]]
    assert roles[-3:] == ["assistant", "tool", "assistant"]
    assert meta["messages"][-2]["content"] == "sunny and 21 degrees in London"


def test_a_tool_that_raises_is_reported_to_the_model(smol):
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: The city name
        """
        raise RuntimeError("station offline")

    events = []
    smol.generate(few_shot("London"), tools=[get_weather], max_turns=2, temperature=0, on_event=events.append)
    [result] = [e for e in events if e["type"] == "tool_result"]
    assert "RuntimeError: station offline" in result["error"]


def _undocumented(city: str) -> str:
    return city


@pytest.mark.parametrize("kwargs,field", [
    ({"tools": [_undocumented]}, "tools[0]"),
    ({"tools": [get_weather, get_weather]}, "tools[1].function.name"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [get_weather], "tool_choice": {"type": "function", "function": {"name": "add"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER_TOOL], "max_turns": 2}, "tools"),
    ({"tools": [get_weather], "max_turns": 0}, "max_turns"),
    ({"max_turns": 2}, "max_turns"),
    ({"tools": [get_weather], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [get_weather], "tools_kwargs": {"get_weather": {}}}, "tools_kwargs"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_malformed_tool_requests_are_typed_errors(smol, kwargs, field):
    with pytest.raises(ToolsError) as err:
        smol.prepare("What is the weather in Oslo?", **kwargs)
    assert err.value.field == field


def test_tools_need_chat_prompts_and_no_cartridge(smol):
    with pytest.raises(ToolsError) as err:
        smol.prepare("raw text", raw=True, tools=[get_weather])
    assert err.value.field == "tools"
    with pytest.raises(ToolsError) as err:
        smol.prepare("hi", tools=[get_weather], cartridge="some-cartridge")
    assert err.value.field == "tools"
    with pytest.raises(PromptError, match="tool_calls"):
        smol.prepare([[{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                                                         "tool_calls": [{"function": {"name": ""}}]}]])


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    path = make_thinking_model(resolve_model_path("builtin:tiny-random-llama"), tmp_path_factory.mktemp("think"))
    with InferenceEngine({"model_path": path, "progress": False,
                          "rollout": {"name": "local", "prompt_length": 512, "response_length": 48}}) as engine:
        yield engine


def test_thinking_model_reasoning_is_split_and_enable_thinking_is_passed(thinking):
    """The template opens <think> in the generation prompt: the random model never closes it, so its whole output
    is reasoning; with enable_thinking false the template closes an empty block and the output is the answer."""
    on = thinking.generate("hi", temperature=0, max_tokens=12)
    text = thinking.tokenizer.decode(on.token_ids[0], skip_special_tokens=True)
    assert on.reasoning[0] == text.strip() and on.completions[0] == ""
    off = thinking.generate("hi", temperature=0, max_tokens=12, chat_template_kwargs={"enable_thinking": False})
    assert off.reasoning == [None] and off.completions[0] == thinking.tokenizer.decode(off.token_ids[0],
                                                                                       skip_special_tokens=True)
    decode = thinking.tokenizer.decode
    assert decode(thinking.prepare("hi").ids[0]).endswith("<|im_start|>assistant\n<think>\n")
    off_ids = thinking.prepare("hi", chat_template_kwargs={"enable_thinking": False}).ids[0]
    assert decode(off_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    [score] = thinking.score(["hi"], [" a"], chat_template_kwargs={"enable_thinking": False})
    assert score.prompt_ids == off_ids


def test_a_model_without_think_tokens_has_no_reasoning(smol):
    out = smol.generate("Say hello.", temperature=0, max_tokens=8)
    assert out.reasoning == [None] and "message" not in out.metadata[0]


def test_multi_turn_template_kwargs_refused_where_the_loop_cannot_take_them():
    """UnsupportedError names the backend and the field, before any work (Capabilities.check)."""
    from final.rollout.base import Capabilities
    from final.sampling import parse_sampling

    with pytest.raises(UnsupportedError) as err:
        Capabilities(tools=True).check("sglang", parse_sampling({}, response_length=8), tools=True, call_tools=True)
    assert (err.value.backend, err.value.field) == ("sglang", "max_turns")


def test_required_and_named_choices_are_held_to_calls(smol):
    """No examples needed: the constraint writes the call in the model's format, its arguments to the schema;
    with parallel_tool_calls false the output ends after the call (finish_reason tool_calls)."""
    out = smol.generate(["What is the weather in Paris?", "What is 2 plus 3?"], tools=[get_weather, add],
                        tool_choice="required", parallel_tool_calls=False, temperature=0)
    assert [[c["function"]["name"] for c in calls] for calls in out.tool_calls] == [["get_weather"], ["add"]]
    assert json.loads(out.tool_calls[0][0]["function"]["arguments"]) == {"city": "Paris"}
    assert json.loads(out.tool_calls[1][0]["function"]["arguments"]) == {"a": 2, "b": 3}
    assert [m["finish_reason"] for m in out.metadata] == ["tool_calls", "tool_calls"]
    assert all("tool_call_errors" not in m for m in out.metadata)
    named = smol.generate("What is the weather in Paris?", tools=[get_weather, add], temperature=0,
                          tool_choice={"type": "function", "function": {"name": "add"}})
    [[call]] = named.tool_calls
    assert call["function"]["name"] == "add" and set(json.loads(call["function"]["arguments"])) >= {"a", "b"}
    assert named.metadata[0]["finish_reason"] == "tool_calls"  # a named choice stops after its call


def test_response_format_json_schema_holds_the_answer(smol):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "temp_c": {"type": "integer"}},
              "required": ["city", "temp_c"], "additionalProperties": False}
    out = smol.generate(["Describe the weather in Paris as JSON.", "Hi!"], temperature=0,
                        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    for text in out.completions:
        value = json.loads(text)
        assert set(value) == {"city", "temp_c"} and isinstance(value["temp_c"], int)
    anything = smol.generate("Hi!", temperature=0, response_format={"type": "json_object"}, max_tokens=24)
    assert anything.metadata[0]["finish_reason"] == "length" or isinstance(json.loads(anything.completions[0]), dict)
    with pytest.raises(ToolsError) as err:  # one constraint per call
        smol.prepare("Hi", tools=[get_weather], tool_choice="required", response_format={"type": "json_object"})
    assert err.value.field == "response_format"
    with pytest.raises(ToolsError) as err:
        smol.prepare("Hi", response_format={"type": "json_object"}, regex="[a-z]+")
    assert err.value.field == "response_format"


def test_thinking_model_constrained_after_its_reasoning(thinking):
    """Reasoning on: the call constraint starts after </think> (the random model never closes the block, so the
    output is reasoning); enable_thinking false: the output is the call at once."""
    request = thinking.prepare("hi", tools=[get_weather], tool_choice="required")
    tag = json.loads(request.sampling.params["structural_tag"])["format"]
    assert tag["type"] == "sequence" and tag["elements"][0]["end"] == "</think>"
    off = thinking.generate("hi", tools=[get_weather], tool_choice="required", temperature=0, max_tokens=40,
                            chat_template_kwargs={"enable_thinking": False})
    assert off.tool_calls[0][0]["function"]["name"] == "get_weather" and off.reasoning == [None]


def test_required_on_a_model_whose_tool_tags_are_tokens(tmp_path):
    """Qwen's <tool_call> is an added non-special token: the grammar reads it as its text (as xgrammar does), so a
    required call may be written with it (final/engine/grammar.py: plain_added_tokens)."""
    from multiturn_helpers import make_tool_model

    path = make_tool_model(resolve_model_path("builtin:tiny-random-llama"), tmp_path / "tool")
    with InferenceEngine({"model_path": path, "progress": False,
                          "rollout": {"name": "local", "prompt_length": 512, "response_length": 48}}) as engine:
        out = engine.generate("hi", tools=[get_weather], tool_choice="required", parallel_tool_calls=False,
                              temperature=0)
        assert out.tool_calls[0][0]["function"]["name"] == "get_weather"
