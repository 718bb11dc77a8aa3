"""A call's `tools`, `tool_choice`, `parallel_tool_calls` and `response_format`, checked once for every entry point
(generate() and `final serve`): ToolsError names the field as it was sent (`tools[2].function.parameters`).

A tool is an OpenAI tool dict (`{"type": "function", "function": {"name", "description", "parameters", "strict"}}`),
a veRL `BaseTool`, or a Python callable: its schema then comes from its type hints and Google-style docstring
(`transformers.utils.get_json_schema`, as veRL's `@function_tool` builds it) and `CallableTool` runs it. Dicts only
describe a tool (the model can call it; nothing runs it); callables and BaseTools can run in the multi-turn loop.
Schemas are checked as JSON Schema (jsonschema's check_schema) and must describe an object (a call's arguments).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import io
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from transformers.utils import get_json_schema
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from final.errors import ToolsError
from final.tools.registry import DEFAULT_TIMEOUT_S, ToolSet
from final.tools.schema_check import schema_problem

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function and response-format names
MAX_TOOLS = 128  # OpenAI's limit per request
MAX_SCHEMA_BYTES = 65536  # one tool's schema as JSON
_TOOL_KEYS, _FUNCTION_KEYS = {"type", "function"}, {"name", "description", "parameters", "strict"}
CHOICES = ("none", "auto", "required")


@dataclass
class ToolSpec:
    """A call's tools: their OpenAI schemas (what the prompt shows), and the ones that can run."""

    schemas: list[dict] = field(default_factory=list)
    toolset: ToolSet = field(default_factory=ToolSet)

    def names(self) -> list[str]:
        return [s["function"]["name"] for s in self.schemas]


def tool_spec(tools: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> ToolSpec | None:
    """`tools` (None, or a non-empty list of dicts, BaseTools and callables) -> ToolSpec."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)) or not tools:
        raise ToolsError("must be a non-empty list of tools (omit it for none)", "tools")
    if len(tools) > MAX_TOOLS:
        raise ToolsError(f"{len(tools)} tools exceed the limit of {MAX_TOOLS}", "tools")
    spec = ToolSpec()
    seen: dict[str, int] = {}
    for i, item in enumerate(tools):
        schema, runner = _one_tool(item, f"tools[{i}]")
        name = schema["function"]["name"]
        if name in seen:
            raise ToolsError(f"duplicate tool name {name!r} (also tools[{seen[name]}])", f"tools[{i}].function.name")
        seen[name] = i
        spec.schemas.append(schema)
        if runner is not None:
            spec.toolset.tools[name] = runner
            spec.toolset.timeouts[name] = timeout_s
    return spec


def _one_tool(item: Any, where: str) -> tuple[dict, BaseTool | None]:
    if isinstance(item, BaseTool):
        return check_tool(item.get_openai_tool_schema().model_dump(exclude_none=True), where), item
    if isinstance(item, dict):
        return check_tool(item, where), None
    if callable(item):
        tool = CallableTool.of(item, where)
        return check_tool(tool.schema, where), tool
    raise ToolsError(f"must be an OpenAI tool dict, a veRL BaseTool or a Python function, got {type(item).__name__}",
                     where)


def check_tool(tool: Any, where: str) -> dict:
    """One OpenAI function tool, checked; returned as a plain dict."""
    if not isinstance(tool, dict):
        raise ToolsError(f"must be an object, got {type(tool).__name__}", where)
    if tool.get("type") != "function":
        raise ToolsError(f"only function tools are served, got type {tool.get('type')!r:.40}", f"{where}.type")
    _no_other_keys(tool, _TOOL_KEYS, where)
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ToolsError("must be an object with a name", f"{where}.function")
    _no_other_keys(fn, _FUNCTION_KEYS, f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ToolsError(f"must be 1-64 letters, digits, _ or -, got {name!r:.80}", f"{where}.function.name")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise ToolsError("must be a string", f"{where}.function.description")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise ToolsError("must be true or false", f"{where}.function.strict")
    if fn.get("parameters") is not None:
        check_schema(fn["parameters"], f"{where}.function.parameters", must_be_object=True)
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def _no_other_keys(value: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise ToolsError(f"unknown key {unknown[0]!r:.60}; allowed: {', '.join(sorted(allowed))}", where)


def check_schema(schema: Any, where: str, must_be_object: bool = False) -> dict:
    """A JSON Schema (object), checked against the 2020-12 metaschema and bounded in size."""
    if not isinstance(schema, dict):
        raise ToolsError(f"must be a JSON Schema object, got {type(schema).__name__}", where)
    try:
        size = len(json.dumps(schema, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as exc:
        raise ToolsError(f"must hold JSON values only ({type(exc).__name__})", where) from None
    if size > MAX_SCHEMA_BYTES:
        raise ToolsError(f"{size} bytes as JSON exceed {MAX_SCHEMA_BYTES}", where)
    if must_be_object and schema.get("type", "object") != "object":
        raise ToolsError(f"must describe an object (a call's arguments), got type {schema.get('type')!r:.40}",
                         f"{where}.type")
    problem = schema_problem(schema)
    if problem is not None:
        message, inner = problem
        raise ToolsError(message, f"{where}.{inner}" if inner else where)
    return schema


def check_tool_choice(choice: Any, spec: ToolSpec | None) -> str | dict | None:
    """tool_choice -> "none" | "auto" | "required" | {"type": "function", "function": {"name"}} (None: no tools).
    OpenAI's default is "auto" with tools."""
    if spec is None:
        if choice is not None:
            raise ToolsError("needs tools: give the tools the model may call", "tool_choice")
        return None
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ToolsError(f"must be none, auto, required or {{'type': 'function', 'function': {{'name': ...}}}}, "
                             f"got {choice!r:.40}", "tool_choice")
        return choice
    if not isinstance(choice, dict) or choice.get("type") != "function" or set(choice) != {"type", "function"}:
        raise ToolsError("a named choice is {'type': 'function', 'function': {'name': ...}}", "tool_choice")
    fn = choice["function"]
    if not isinstance(fn, dict) or set(fn) != {"name"} or not isinstance(fn["name"], str):
        raise ToolsError("must be {'name': ...}", "tool_choice.function")
    if fn["name"] not in spec.names():
        raise ToolsError(f"names {fn['name']!r:.80}, which is not among the tools ({', '.join(spec.names())})",
                         "tool_choice.function.name")
    return {"type": "function", "function": {"name": fn["name"]}}


def check_parallel(value: Any) -> bool:
    if value is None:
        return True
    if not isinstance(value, bool):
        raise ToolsError(f"must be true or false, got {value!r:.40}", "parallel_tool_calls")
    return value


def check_response_format(value: Any) -> dict | None:
    """OpenAI's response_format: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema",
    "json_schema": {"name", "description"?, "schema"?, "strict"?}}."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise ToolsError("must be {'type': 'text' | 'json_object' | 'json_schema', ...}", "response_format")
    kind = value["type"]
    _no_other_keys(value, {"type", "json_schema"} if kind == "json_schema" else {"type"}, "response_format")
    if kind != "json_schema":
        return {"type": kind}
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ToolsError("must be an object with a name and a schema", "response_format.json_schema")
    _no_other_keys(spec, {"name", "description", "schema", "strict"}, "response_format.json_schema")
    if not isinstance(spec.get("name"), str) or not NAME.match(spec["name"]):
        raise ToolsError(f"must be 1-64 letters, digits, _ or -, got {spec.get('name')!r:.80}",
                         "response_format.json_schema.name")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ToolsError("must be true or false", "response_format.json_schema.strict")
    if spec.get("schema") is not None:
        check_schema(spec["schema"], "response_format.json_schema.schema")
    return {"type": kind, "json_schema": dict(spec)}


class CallableTool(BaseTool):
    """A Python function as a veRL tool: its schema from get_json_schema, each call `fn(**arguments)` (a coroutine
    function awaited, a plain one on a worker thread), its return value read as veRL 0.9's function tools read it:
    a ToolResponse, a str, a dict (as JSON), or (response, reward, metrics); anything else as str()."""

    def __init__(self, fn: Callable[..., Any], schema: dict):
        self.fn = fn
        self.schema = schema
        with contextlib.redirect_stdout(io.StringIO()):  # BaseTool.__init__ prints its schema
            super().__init__({"type": "native"}, verl_schema(schema))

    @classmethod
    def of(cls, fn: Callable[..., Any], where: str) -> "CallableTool":
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError) as exc:
            raise ToolsError(f"has no signature to build a schema from: {exc}", where) from None
        variadic = [p.name for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if variadic:
            raise ToolsError(f"takes *args/**kwargs ({', '.join(variadic)}), which no tool schema can describe", where)
        try:
            schema = get_json_schema(fn)
            schema["function"].pop("return", None)  # the return value's schema: no part of a call
        except Exception as exc:  # noqa: BLE001 - transformers' TypeHintParsingException / DocstringParsingException
            raise ToolsError(f"{getattr(fn, '__name__', 'the function')}: {exc} (a tool function needs a type hint "
                             "on every argument and a Google-style docstring describing each)", where) from None
        return cls(fn, schema)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple:
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(**parameters)
        else:
            result = await asyncio.to_thread(self.fn, **parameters)
        return tool_result(result)


def verl_schema(schema: dict) -> OpenAIFunctionToolSchema:
    """veRL's model of a tool schema (what its AsyncRolloutRequest renders in the multi-turn loop): a description,
    flat properties of one type each (a nested or union type is named by its JSON), and the required list."""
    fn = schema["function"]
    params = fn.get("parameters") or {}
    props = {}
    for key, prop in (params.get("properties") or {}).items():
        kind = prop.get("type", "object") if isinstance(prop, dict) else "object"
        enum = prop.get("enum") if isinstance(prop, dict) else None
        props[key] = {"type": kind if isinstance(kind, str) else json.dumps(kind),
                      "description": prop.get("description") if isinstance(prop, dict) else None,
                      "enum": [str(e) for e in enum] if isinstance(enum, list) else None}
    return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
        "name": fn["name"], "description": fn.get("description") or "", "strict": bool(fn.get("strict")),
        "parameters": {"type": "object", "properties": props, "required": list(params.get("required") or [])}}})


def tool_result(value: Any) -> tuple[ToolResponse, float, dict]:
    """A tool function's return value -> (ToolResponse, reward, metrics)."""
    if isinstance(value, tuple):
        if not 1 <= len(value) <= 3:
            raise TypeError(f"a tool's tuple result must be (response[, reward[, metrics]]), got {len(value)} items")
        reward = 0.0 if len(value) < 2 or value[1] is None else float(value[1])
        metrics = {} if len(value) < 3 or value[2] is None else dict(value[2])
        return _response(value[0]), reward, metrics
    return _response(value), 0.0, {}


def _response(value: Any) -> ToolResponse:
    if isinstance(value, ToolResponse):
        return value
    if isinstance(value, str):
        return ToolResponse(text=value)
    if isinstance(value, (dict, list)):
        return ToolResponse(text=json.dumps(value, ensure_ascii=False, default=str))
    return ToolResponse(text=str(value))
