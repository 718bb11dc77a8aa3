"""OpenAI tool calling on a real `final serve` (SmolLM2, real HTTP on 127.0.0.1) driven by the official `openai`
SDK: tools rendered by the fallback prompt, the model's call parsed into message.tool_calls (ids, JSON arguments,
finish_reason "tool_calls"), tool_choice none / auto / required / named (the last two constrained), streaming tool
calls accumulated by the SDK's stream helper and equal to the non-streaming answer, a tool-result turn,
response_format json_schema read by the SDK's parse() into a pydantic model, SGLang's json_schema on completions,
the fields clients send that change nothing (accepted) and the ones not served (refused naming them); and
reasoning_content from a thinking model (message and stream deltas)."""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest

from final.inf import InferenceEngine
from final.models import resolve_model_path
from final.server.app import ServerThread, create_app
from tools_helpers import SMOL, WEATHER_TOOL, few_shot, make_thinking_model

pytestmark = pytest.mark.slow


def _serve(config: dict):
    inference = InferenceEngine(config)
    try:
        return inference, ServerThread(create_app(inference))
    except BaseException:
        inference.shutdown()
        raise


@pytest.fixture(scope="module")
def smol_server():
    inference, server = _serve({"model_path": SMOL, "progress": False,
                                "rollout": {"name": "local", "prompt_length": 1024, "response_length": 48}})
    yield server
    server.stop()
    inference.shutdown()


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="unused", max_retries=0, timeout=600)


def _ask(client, messages, **kw):
    return client.chat.completions.create(model="m", messages=messages, temperature=0, **kw)


def test_the_models_call_comes_back_as_tool_calls(client):
    out = _ask(client, few_shot("London"), tools=[WEATHER_TOOL], tool_choice="auto",
               store=True, metadata={"run": "t"}, user="u1", service_tier="auto",  # accepted, ignored
               extra_body={"prompt_cache_key": "k", "safety_identifier": "s"})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "London"})
    assert out.usage.completion_tokens > 0
    # the same conversation on the cartridge chat route (no cartridge): the same call
    raw = httpx.post(f"{str(client.base_url).removesuffix('/v1/')}/custom/cartridge/chat/completions", timeout=600,
                     json={"model": "m", "messages": few_shot("London"), "tools": [WEATHER_TOOL], "temperature": 0})
    assert raw.json()["choices"][0]["message"]["tool_calls"][0]["function"] == call.function.model_dump()


def test_tool_choice_none_is_text(client):
    out = _ask(client, few_shot("London"), tools=[WEATHER_TOOL], tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content.startswith("<tool_call>")


def test_streamed_tool_calls_accumulate_to_the_same_answer(client):
    plain = _ask(client, few_shot("London"), tools=[WEATHER_TOOL])
    with client.chat.completions.stream(model="m", messages=few_shot("London"), tools=[WEATHER_TOOL],
                                        temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    choice, ref = final.choices[0], plain.choices[0]
    assert choice.finish_reason == "tool_calls" == ref.finish_reason
    [call], [ref_call] = choice.message.tool_calls, ref.message.tool_calls
    assert call.function.name == ref_call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == json.loads(ref_call.function.arguments) == {"city": "London"}
    deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert "".join(e.arguments_delta for e in deltas) == call.function.arguments
    assert not any(e.type == "content.delta" and "<tool" in e.delta for e in events)  # no marker sent as text


def test_raw_stream_chunks_have_openais_delta_shape(smol_server):
    body = {"model": "m", "messages": few_shot("London"), "tools": [WEATHER_TOOL], "temperature": 0, "stream": True}
    chunks = []
    with httpx.stream("POST", f"{smol_server.url}/v1/chat/completions", json=body, timeout=600) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    deltas = [c["choices"][0] for c in chunks]
    calls = [d["delta"]["tool_calls"][0] for d in deltas if d["delta"].get("tool_calls")]
    first = calls[0]
    assert set(first) == {"index", "id", "type", "function"} and first["index"] == 0
    assert first["function"]["name"] == "get_weather" and first["type"] == "function"
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert all(d["finish_reason"] is None for d in deltas[:-1])


def test_required_and_named_tool_choice_are_constrained_calls(client):
    plain = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = _ask(client, plain, tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False)
    [call] = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    named = _ask(client, [{"role": "user", "content": "Hi!"}], tools=[WEATHER_TOOL],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    with client.chat.completions.stream(model="m", messages=plain, tools=[WEATHER_TOOL], tool_choice="required",
                                        parallel_tool_calls=False, temperature=0) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == \
        out.choices[0].message.tool_calls[0].function.arguments


class Weather(pydantic.BaseModel):
    city: str
    temperature_celsius: int
    sunny: bool


def test_response_format_json_schema_parses_into_the_model(client, smol_server):
    out = client.chat.completions.parse(model="m", temperature=0, response_format=Weather, max_tokens=48,
                                        messages=[{"role": "user", "content": "The weather in Paris, as JSON."}])
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Weather) and parsed.city
    anything = _ask(client, [{"role": "user", "content": "Give me a JSON object."}], max_tokens=40,
                    response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    raw = httpx.post(f"{smol_server.url}/v1/completions", timeout=600, json={  # SGLang's field, on completions
        "model": "m", "prompt": "The number of days in a week, as JSON:", "max_tokens": 16, "temperature": 0,
        "json_schema": schema}).json()
    assert set(json.loads(raw["choices"][0]["text"])) == {"n"}


def test_a_tool_result_turn_is_answered(client):
    plain = _ask(client, few_shot("London"), tools=[WEATHER_TOOL])
    call = plain.choices[0].message.tool_calls[0]
    messages = few_shot("London") + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "foggy, 12 degrees"}]
    out = _ask(client, messages, tools=[WEATHER_TOOL])
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


def test_unserved_fields_are_refused_naming_them(client):
    for kwargs, param in [({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
                          ({"extra_body": {"verbosity": "low"}}, "verbosity"),
                          ({"modalities": ["text", "audio"]}, "modalities"),
                          ({"extra_body": {"web_search_options": {}}}, "web_search_options")]:
        with pytest.raises(openai.BadRequestError) as err:
            _ask(client, [{"role": "user", "content": "hi"}], max_tokens=2, **kwargs)
        assert err.value.body["param"] == param


def test_developer_role_and_reasoning_effort_are_served(client):
    out = _ask(client, [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}],
               max_tokens=4, reasoning_effort="low")
    assert out.choices[0].message.content is not None


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    path = make_thinking_model(resolve_model_path("builtin:tiny-random-llama"), tmp_path_factory.mktemp("think"))
    inference, server = _serve({"model_path": path, "progress": False,
                                "rollout": {"name": "local", "prompt_length": 256, "response_length": 16}})
    yield inference, server
    server.stop()
    inference.shutdown()


def test_reasoning_content_in_message_and_stream(thinking_server):
    inference, server = thinking_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=10)
    message = out.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and not message.content
    ref = inference.generate("hi", temperature=0, max_tokens=10)
    assert reasoning == ref.reasoning[0]
    stream = client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=10, stream=True)
    pieces = [c.choices[0].delta.model_extra.get("reasoning_content") for c in stream if c.choices]
    assert "".join(p for p in pieces if p) == reasoning
    off = client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=10,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.model_extra["reasoning_content"] is None
    assert off.choices[0].message.content == inference.generate(
        "hi", temperature=0, max_tokens=10, chat_template_kwargs={"enable_thinking": False}).completions[0]
