"""Malformed tool-calling requests on a real `final serve` (issue 80): every case of the generated table - tools,
tool_choice, parallel_tool_calls, response_format, chat_template_kwargs, messages carrying tool calls, fields that
are not served - is a 400 with an OpenAI error body naming the field (`param`), while a good tool request runs
concurrently on another connection and is answered whole, and the server answers afterwards."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from conftest import tiny_config
from final.inf import InferenceEngine
from final.server.app import ServerThread, create_app
from tools_helpers import WEATHER_TOOL

USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
GOOD = {"model": "m", "messages": USER, "tools": [WEATHER_TOOL], "max_tokens": 4, "temperature": 0}


def _tool(**function) -> dict:
    return {"type": "function", "function": {"name": "f", **function}}


def _params(schema) -> dict:
    return _tool(parameters=schema)


def _tool_cases() -> list[tuple[dict, str]]:
    bad_tools = ["get_weather", 5, {"type": "function"}, True, {"a": 1}, []]
    cases = [({"tools": t}, "tools") for t in bad_tools]
    cases += [({"tools": [t]}, "tools[0]") for t in [1, "x", None, [], 2.5, True]]
    cases += [({"tools": [WEATHER_TOOL] * 129}, "tools")]
    types = [None, "code_interpreter", "custom", 1, "", "Function", ["function"]]
    cases += [({"tools": [{"type": t, "function": {"name": "f"}}]}, "tools[0].type") for t in types]
    cases += [({"tools": [{"type": "function", "function": f}]}, "tools[0].function")
              for f in [None, "f", 3, [], {"description": "no name"} | {"x": 1}]]
    cases += [({"tools": [{"type": "function", "function": {"name": "f"}, "extra": 1}]}, "tools[0]")]
    names = ["", "a b", "x" * 65, 7, None, "é", "a.b", "tool/1", ["f"], {"n": 1}]
    cases += [({"tools": [{"type": "function", "function": {"name": n}}]}, "tools[0].function.name") for n in names]
    cases += [({"tools": [_tool(description=d)]}, "tools[0].function.description") for d in [1, [], {}, True]]
    cases += [({"tools": [_tool(strict=s)]}, "tools[0].function.strict") for s in ["yes", 1, [], "true"]]
    cases += [({"tools": [_tool(unknown="x")]}, "tools[0].function")]
    cases += [({"tools": [_params(p)]}, "tools[0].function.parameters") for p in [[], "object", 3, True, ["a"]]]
    cases += [({"tools": [_params({"type": t})]}, "tools[0].function.parameters.type")
              for t in ["string", "array", "null", 5, "strng", ["object", "null"]]]
    schemas = [{"type": "object", "properties": 3}, {"type": "object", "properties": {"a": {"type": "strng"}}},
               {"type": "object", "required": "a"}, {"type": "object", "required": [1]},
               {"type": "object", "properties": {"a": {"enum": "x"}}},
               {"type": "object", "properties": {"a": {"type": "array", "items": 3}}},
               {"type": "object", "additionalProperties": "no"}, {"type": "object", "minProperties": -1},
               {"type": "object", "properties": {"a": {"minimum": "zero"}}},
               {"type": "object", "properties": {"a": {"pattern": 5}}}, {"type": "object", "$ref": 5},
               {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": 9}}}}},
               {"type": "object", "properties": {"a": {"anyOf": {}}}}, {"type": "object", "description": 5},
               {"type": "object", "properties": {"x" * 10: {"description": "d" * 70000}}}]
    cases += [({"tools": [_params(s)]}, "tools[0].function.parameters") for s in schemas]
    cases += [({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools[1].function.name"),
              ({"tools": [WEATHER_TOOL, _tool(), _tool()]}, "tools[2].function.name")]
    return cases


def _choice_cases() -> list[tuple[dict, str]]:
    tools = {"tools": [WEATHER_TOOL]}
    cases = [({**tools, "tool_choice": c}, "tool_choice") for c in ["always", "", "AUTO", "Required", "any"]]
    cases += [({**tools, "tool_choice": c}, "tool_choice") for c in [1, True, ["auto"], 2.5]]
    cases += [({**tools, "tool_choice": c}, "tool_choice")
              for c in [{}, {"type": "tool"}, {"type": "function"}, {"function": {"name": "get_weather"}},
                        {"type": "function", "function": {"name": "get_weather"}, "extra": 1},
                        {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}]]
    cases += [({**tools, "tool_choice": {"type": "function", "function": f}}, "tool_choice.function")
              for f in ["get_weather", None, [], {"name": 5}, {"name": "get_weather", "x": 1}, {}]]
    cases += [({**tools, "tool_choice": {"type": "function", "function": {"name": n}}}, "tool_choice.function.name")
              for n in ["get_wether", "GET_WEATHER", "", "x" * 300]]
    cases += [({"tool_choice": c}, "tool_choice") for c in ["none", "auto", "required",
                                                              {"type": "function", "function": {"name": "f"}}]]
    cases += [({**tools, "parallel_tool_calls": p}, "parallel_tool_calls") for p in ["yes", 1, "true", [], {}]]
    return cases


def _format_cases() -> list[tuple[dict, str]]:
    cases = [({"response_format": f}, "response_format")
             for f in ["json", ["json_object"], 3, {}, {"type": "xml"}, {"type": None}, {"type": "json_object", "x": 1},
                       {"type": "text", "json_schema": {}}]]
    cases += [({"response_format": {"type": "json_schema", "json_schema": s}}, "response_format.json_schema")
              for s in [None, "schema", 3, [], {"schema": {"type": "object"}} | {"bad": 1}]]
    cases += [({"response_format": {"type": "json_schema", "json_schema": {"name": n}}},
               "response_format.json_schema.name") for n in [None, "", "a b", 5, "y" * 65]]
    cases += [({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": s}}},
               "response_format.json_schema.schema")
              for s in ["object", 5, [], {"type": 5}, {"properties": 3}, {"required": "a"}, {"enum": 1}]]
    cases += [({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "strict": s}}},
               "response_format.json_schema.strict") for s in ["yes", 1]]
    cases += [({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
               "response_format"),  # one constraint per request
              ({"response_format": {"type": "json_object"}, "regex": "[a-z]+"}, "response_format"),
              ({"tools": [WEATHER_TOOL], "tool_choice": "required", "ebnf": 'root ::= "a"'}, "tool_choice"),
              ({"regex": "[a-z]+", "ebnf": 'root ::= "a"'}, "ebnf")]
    cases += [({"regex": r}, "regex") for r in [5, ["a"], "(unclosed", ""]]
    cases += [({"ebnf": e}, "ebnf") for e in [{}, "root ::= undefined_rule", "not a grammar ::= ::="]]
    return cases


def _kwargs_cases() -> list[tuple[dict, str]]:
    cases = [({"chat_template_kwargs": k}, "chat_template_kwargs") for k in ["x", 3, ["a"], True]]
    cases += [({"chat_template_kwargs": {k: True}}, f"chat_template_kwargs.{k}")
              for k in ["tools", "tokenize", "chat_template", "messages", "add_generation_prompt", "return_dict",
                        "documents", "continue_final_message"]]
    cases += [({"chat_template_kwargs": {k: 1}}, "chat_template_kwargs") for k in ["a b", "1x", "", "x-y"]]
    cases += [({"chat_template_kwargs": {"big": "z" * 20000}}, "chat_template_kwargs")]
    cases += [({"reasoning_effort": e}, "reasoning_effort") for e in ["max", 1, "HIGH", ""]]
    cases += [({"modalities": m}, "modalities") for m in [["audio"], ["text", "audio"], "text", [1]]]
    cases += [({f: v}, f) for f, v in [("functions", [{"name": "f"}]), ("function_call", "auto"), ("audio", {}),
                                       ("verbosity", "low"), ("web_search_options", {}), ("max_turns", 2),
                                       ("tools_kwargs", {}), ("store", "yes"), ("service_tier", 5)]]
    return cases


def _call(**function) -> dict:
    return {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}", **function}}


def _message_cases() -> list[tuple[dict, str]]:
    def convo(assistant: dict) -> list:
        return USER + [assistant, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]

    bad_calls = ["c", {"id": "c1"}, 3, [1], [None], [{"function": "get_weather"}], [{"type": "function"}],
                 [_call(name="")], [_call(name=5)], [_call(arguments=5)], [_call(arguments=[1])],
                 [{"id": 1, "type": "function", "function": {"name": "f"}}],
                 [{"id": "c", "type": "tool", "function": {"name": "f"}}], [{"id": "c", "function": {}}]]
    cases = [({"messages": convo({"role": "assistant", "content": None, "tool_calls": c})}, "messages")
             for c in bad_calls]
    cases += [({"messages": USER + [{"role": "assistant", "content": None}]}, "messages"),
              ({"messages": [{"role": "user", "content": "x", "tool_calls": [_call()]}]}, "messages"),
              ({"messages": USER + [{"role": "tool", "content": None}]}, "messages"),
              ({"messages": USER + [{"role": "tool", "tool_call_id": 5, "content": "x"}]}, "messages"),
              ({"messages": [{"role": "user", "content": "x", "name": 3}]}, "messages"),
              ({"messages": [{"role": "function", "content": "x"}]}, "messages"),
              ({"messages": [{"role": "assistant", "content": 5}]}, "messages")]
    return cases


CASES = _tool_cases() + _choice_cases() + _format_cases() + _kwargs_cases() + _message_cases()


def test_the_table_is_large_enough():
    assert len(CASES) >= 150


@pytest.fixture(scope="module")
def server():
    inference = InferenceEngine(tiny_config(prompt_length=512, response_length=8))
    try:
        with ServerThread(create_app(inference)) as srv:
            yield srv
    finally:
        inference.shutdown()


def test_each_malformed_request_is_a_400_naming_its_field(server):
    stop, good = threading.Event(), []

    def good_requests() -> None:  # a well-formed tool request, again and again, on its own connection
        with httpx.Client(base_url=server.url, timeout=120) as client:
            while not stop.is_set():
                resp = client.post("/v1/chat/completions", json=GOOD)
                good.append((resp.status_code, resp.json()["choices"][0]["finish_reason"]))

    worker = threading.Thread(target=good_requests)
    worker.start()
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for patch, param in CASES:
                body = {"model": "m", "messages": USER, "max_tokens": 2, **patch}
                resp = client.post("/v1/chat/completions", content=json.dumps(body).encode(),
                                   headers={"content-type": "application/json"})
                assert resp.status_code == 400, (patch, resp.text[:300])
                err = resp.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"], err
                assert err["type"] == "invalid_request_error"
                assert err["param"] == param or str(err["param"]).startswith(f"{param}."), (patch, err)
    finally:
        stop.set()
        worker.join()
    assert good and all(status == 200 and reason in ("stop", "length") for status, reason in good)
    assert httpx.get(f"{server.url}/ping").json() == {"message": "pong"}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=GOOD, timeout=120).status_code == 200
