"""tools.yaml loading (final/tools/registry.py) and multi_turn settings: every mistake is a typed error at start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from final.compat import MULTI_TURN_UNSERVED, TOOL_MODULES
from final.errors import ToolConfigError
from final.models import resolve_model_path
from final.rollout.multi_turn import MultiTurnRollout
from final.tools.registry import load_tools
from multiturn_helpers import ScriptedEngine, rollout_config
from multiturn_tools import schema

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, doc) -> Path:
    path = tmp_path / "tools.yaml"
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return path


def entry(cls: str = "multiturn_tools.EchoTool", name: str = "echo", **extra) -> dict:
    return {"class_name": cls, "config": {"type": "native"}, "tool_schema": schema(name), **extra}


def test_shipped_tools_yaml_loads_gsm8k_tool():
    import importlib

    # veRL 0.9 removed verl.tools.gsm8k_tool: there the file's class is final's port (final.compat.TOOL_MODULES)
    module = TOOL_MODULES.get("verl.tools.gsm8k_tool", "verl.tools.gsm8k_tool")
    gsm8k_tool = importlib.import_module(module).Gsm8kTool
    tools = load_tools(ROOT / "tools.yaml")
    assert tools.names() == ["calc_gsm8k_reward"] and isinstance(tools["calc_gsm8k_reward"], gsm8k_tool)
    assert tools.timeouts["calc_gsm8k_reward"] == 30.0
    if not TOOL_MODULES:  # the same file is valid for veRL 0.6.0's own loader (it ignores our timeout_s)
        from verl.tools.utils.tool_registry import initialize_tools_from_config

        assert [t.name for t in initialize_tools_from_config(str(ROOT / "tools.yaml"))] == ["calc_gsm8k_reward"]


def test_several_tools_in_file_order(tmp_path):
    tools = load_tools(write(tmp_path, {"tools": [entry(name="b"), entry("multiturn_tools.RaisingTool", "a",
                                                                        timeout_s=0.5)]}))
    assert tools.names() == ["b", "a"] and tools.timeouts == {"b": 60.0, "a": 0.5}
    assert [s["function"]["name"] for s in tools.schemas()] == ["b", "a"]


@pytest.mark.parametrize("doc, key, words", [
    ("tools: [\n  - class_name: x\n  bad", None, "invalid YAML"),
    ("- just a list", "tools", "'tools' list"),
    ({"tools": []}, "tools", "non-empty list"),
    ({"tools": ["verl.tools.gsm8k_tool.Gsm8kTool"]}, "tools[0]", "must be a mapping"),
    ({"tools": [entry(cls="Gsm8kTool")]}, "tools[0].class_name", "dotted path"),
    ({"tools": [entry(cls="no_such_module.Tool")]}, "tools[0].class_name", "cannot import module"),
    ({"tools": [entry(cls="verl.tools.gsm8k_tool.NoSuchTool")]}, "tools[0].class_name", "has no class"),
    ({"tools": [entry(cls="multiturn_tools.NotATool")]}, "tools[0].class_name", "not a subclass of"),
    ({"tools": [{**entry(), "config": None}]}, "tools[0].config", "type: native"),
    ({"tools": [{**entry(), "config": {"type": "mcp"}}]}, "tools[0].config.type", "only 'native'"),
    ({"tools": [{**entry(), "config": {"type": "natve"}}]}, "tools[0].config.type", "unsupported tool type"),
    ({"tools": [{**entry(), "tool_schema": {"type": "function", "function": {"description": "no name"}}}]},
     "tools[0].tool_schema.function.name", "Field required"),
    ({"tools": [{**entry(), "tool_schema": {"type": "function", "function": {
        "name": "f", "description": "d", "parameters": {"type": "object", "properties": {}, "required": "x"}}}}]},
     "tools[0].tool_schema.function.parameters.required", "list"),
    ({"tools": [entry(), entry(name="echo")]}, "tools[1].tool_schema.function.name", "duplicate tool name"),
    ({"tools": [entry(timeout_s=0)]}, "tools[0].timeout_s", "positive number"),
    ({"tools": [entry(timeout_s="10")]}, "tools[0].timeout_s", "positive number"),
    ({"tools": [entry(clas_name="typo")]}, "tools[0]", "unknown keys ['clas_name']"),
    ({"tools": [entry(cls="multiturn_tools.BrokenInitTool")]}, "tools[0]", "could not be constructed"),
    ({"tools": [{**entry(cls="verl.tools.gsm8k_tool.Gsm8kTool"), "tool_schema": None}]}, "tools[0]",
     "could not be constructed"),
])
def test_bad_tools_yaml(tmp_path, doc, key, words):
    path = write(tmp_path, doc)
    with pytest.raises(ToolConfigError) as err:
        load_tools(path)
    assert err.value.key == key and err.value.path == str(path)
    assert words in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(ToolConfigError, match="not found"):
        load_tools(tmp_path / "nope.yaml")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-random-llama"))


@pytest.mark.parametrize("multi_turn, key", [
    ({"format": "gpt-oss"}, "rollout.multi_turn.format"),
    ({"tool_response_truncate_side": "top"}, "rollout.multi_turn.tool_response_truncate_side"),
    ({"max_parallel_calls": 0}, "rollout.multi_turn.max_parallel_calls"),
    ({"max_tool_response_length": -5}, "rollout.multi_turn.max_tool_response_length"),
    ({"max_assistant_turns": 0}, "rollout.multi_turn.max_assistant_turns"),
    # veRL's settings the loop does not serve: interaction_config_path (0.6.0), function_tool_path (0.9.1)
    *[({name: "unserved.yaml"}, f"rollout.multi_turn.{name}") for name in MULTI_TURN_UNSERVED],
])
def test_bad_multi_turn_settings(tokenizer, multi_turn, key):
    config = rollout_config(multi_turn={"tool_config_path": str(ROOT / "tools.yaml"), **multi_turn})
    with pytest.raises(ToolConfigError) as err:
        MultiTurnRollout(ScriptedEngine(tokenizer, {}), config, tokenizer)
    assert err.value.key == key


def test_missing_tool_config_path_is_a_typed_error(tokenizer, tmp_path):
    config = rollout_config(multi_turn={"tool_config_path": str(tmp_path / "missing.yaml")})
    with pytest.raises(ToolConfigError, match="not found"):
        MultiTurnRollout(ScriptedEngine(tokenizer, {}), config, tokenizer)


def test_verl_defaults_are_filled_in(tokenizer):
    config = rollout_config(multi_turn={"tool_config_path": str(ROOT / "tools.yaml")})
    rollout = MultiTurnRollout(ScriptedEngine(tokenizer, {}), config, tokenizer)
    # SGLangRollout._verify_config: max_model_len = prompt + response, turns = max_model_len // 3; kept on the
    # rollout, not written into the config (veRL mutates it; ours may be shared with other rollouts)
    assert rollout.max_model_len == 256 + 128
    assert rollout.max_assistant_turns == rollout.max_user_turns == 384 // 3
    assert config.max_model_len is None and config.multi_turn.max_assistant_turns is None
    # SGLangRollout._init_sampling_params for this config (shared with the batch path: final/rollout/batch.py)
    assert rollout.sampling_params == {"n": 1, "max_new_tokens": 128, "presence_penalty": 0.0,
                                       "frequency_penalty": 0.0, "repetition_penalty": 1.0, "temperature": 1.0,
                                       "top_k": -1, "top_p": 1.0, "ignore_eos": False}


def test_a_schema_nested_too_deeply_is_a_typed_error(tmp_path):
    """jsonschema's metaschema check recurses once per level: a deep schema is named, not a RecursionError."""
    deep: dict = {"type": "string"}
    for _ in range(300):
        deep = {"type": "array", "items": deep}
    doc = entry()
    doc["tool_schema"]["function"]["parameters"] = {"type": "object", "properties": {"x": deep}, "required": []}
    path = write(tmp_path, json.dumps({"tools": [doc]}))  # JSON is YAML; yaml.safe_dump recurses deeper
    with pytest.raises(ToolConfigError, match="nested too deeply") as err:
        load_tools(path)
    assert err.value.key == "tools[0].tool_schema.function.parameters"
