"""tool_choice and response_format -> the constraint sampling keys (SGLang's names, served by the grammar backend):
`structural_tag` for tool calls in the model's own format, `json_schema` for JSON answers.

A call constraint is xgrammar's `triggered_tags` structural tag (SGLang's `get_structure_constraint`, xgrammar's
builtin tags for llama / qwen_3): text is free until the model writes the format's trigger (`<tool_call>`,
`<|python_tag|>`, `[TOOL_CALLS]`), then one of the offered tools' tags is enforced, its arguments held to the tool's
JSON schema, closed (`closed`: no properties beyond those listed, as xgrammar's strict mode reads a schema;
`{"type": "object"}` where the tool declares `strict: false` or no parameters).
  tool_choice "required"  every tool's tag, at least one call
  tool_choice {function}  that tool's tag only, at least one call, stopping after it
  tool_choice "auto"      constrained only when a tool says `strict: true` (SGLang's rule); no call is required
  tool_choice "none"      nothing
parallel_tool_calls false stops after the first call. `calls_constraint` is "auto" with every tool strict: what
rollout.multi_turn.constrain_tool_calls holds each assistant turn of an RL rollout to.

A thinking model (reasoning parser on, thinking not turned off by enable_thinking=false) reasons first: its
constraint becomes a sequence whose first part is free text up to `</think>` (xgrammar's builtin tags for Qwen3
and DeepSeek-R1 do the same), so the reasoning is never held to the answer's grammar.
"""

from __future__ import annotations

import json
from typing import Any

# (begin prefix before the name, between the name and the arguments, end, trigger) per family
_TAGS = {
    "hermes": ('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "<tool_call>"),
    "qwen25": ('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "<tool_call>"),
    "llama3": ('<|python_tag|>{"name": "', '", "parameters": ', "}", "<|python_tag|>"),
    "mistral": ('[TOOL_CALLS] [{"name": "', '", "arguments": ', "}]", "[TOOL_CALLS]"),
}
ANY_OBJECT = {"type": "object"}


def tool_constraint(family: str, tools: list[dict], choice: Any, parallel: bool) -> dict[str, Any]:
    """The sampling keys that hold a call to `choice` ({} where nothing is constrained)."""
    if choice == "none" or not tools:
        return {}
    if choice == "auto" and not any(t["function"].get("strict") is True for t in tools):
        return {}
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    offered = [t for t in tools if named is None or t["function"]["name"] == named]
    prefix, middle, end, trigger = _TAGS[family]
    tags = [{"type": "tag", "begin": f"{prefix}{t['function']['name']}{middle}",
             "content": {"type": "json_schema", "json_schema": _arguments_schema(t["function"])}, "end": end}
            for t in offered]
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": [trigger], "tags": tags, "at_least_one": choice != "auto",
        "stop_after_first": named is not None or not parallel}}
    return {"structural_tag": json.dumps(tag, ensure_ascii=False)}


def calls_constraint(family: str, tools: list[dict], parallel: bool) -> dict[str, Any]:
    """tool_choice "auto" with every tool held to its schema: text stays free, and a call the model starts (the
    format's trigger) must be a call of one of `tools` whose arguments validate (declared `strict: false` too)."""
    strict = [{**t, "function": {**t["function"], "strict": True, **_compact(t["function"].get("parameters"))}}
              for t in tools]
    return tool_constraint(family, strict, "auto", parallel)


# JSON written as json.dumps (and chat templates' tojson) write it, with no whitespace beyond it: under flexible
# whitespace (SGLang's default) a small policy can spend its whole turn on blanks inside a call and be cut off
# (xgrammar bounds the same with max_whitespace_cnt); llguidance's schema option
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _compact(parameters: Any) -> dict:
    if not isinstance(parameters, dict) or not parameters:
        return {}
    return {"parameters": {**parameters, "x-guidance": COMPACT}}


def _arguments_schema(function: dict) -> dict:
    if function.get("strict") is False or not function.get("parameters"):
        return ANY_OBJECT
    return closed(function["parameters"])


def response_constraint(response_format: dict | None) -> dict[str, Any]:
    """response_format (checked by final.tools.spec.check_response_format) -> {"json_schema": ...} or {}."""
    if response_format is None or response_format["type"] == "text":
        return {}
    if response_format["type"] == "json_object":
        return {"json_schema": json.dumps(ANY_OBJECT)}
    schema = closed(response_format["json_schema"].get("schema") or ANY_OBJECT)
    return {"json_schema": json.dumps(schema, ensure_ascii=False)}


_SUBSCHEMAS = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")


def closed(schema: Any) -> Any:
    """A schema whose objects that list `properties` take no others unless they say so (additionalProperties:
    false): what xgrammar's strict mode, SGLang's default, reads a schema as, and what OpenAI's strict schemas
    spell out. A constrained call then holds the arguments it describes, not the extra keys a small model invents."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = closed(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed(v) for k, v in out[key].items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def after_reasoning(keys: dict[str, Any]) -> dict[str, Any]:
    """A constraint (structural_tag or json_schema) that applies once the model has closed its <think> block."""
    if not keys:
        return keys
    if "structural_tag" in keys:
        inner = json.loads(keys["structural_tag"])["format"]
    else:
        inner = {"type": "json_schema", "json_schema": json.loads(keys["json_schema"])}
    think = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": "</think>"}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [think, inner]}}
    return {"structural_tag": json.dumps(tag, ensure_ascii=False)}
