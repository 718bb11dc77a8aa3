"""rollout.multi_turn.constrain_tool_calls: a policy that starts tool calls often and writes garbage inside them
(the tiny random tool model with <tool_call> made likely where an assistant turn starts) rolls out through veRL's
contract (DataProto in, generate_sequences, DataProto out) on the embedded engine. At the same seed, without the
key some of its calls are malformed; with it, every call parses and its arguments validate against the schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from final.compat import chat_ids
from final.config import load_config
from final.errors import ConfigError, ToolConfigError
from final.models import resolve_model_path
from final.rollout.local import LocalRollout
from final.tools.registry import load_tools
from multiturn_helpers import chat_batch, make_tool_model, rollout_config

TOOLS = """tools:
  - class_name: multiturn_tools.EchoTool
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: add
        description: Add two integers.
        parameters:
          type: object
          properties:
            a: {type: integer, description: first number}
            b: {type: integer, description: second number}
          required: [a, b]
"""
ARGUMENTS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}
QUESTIONS = ["What is 17 plus 25?", "Add 301 and 45.", "How much is 8 plus 13?", "What do 120 and 7 make?"]
TOOL_CALL_ID = 11  # make_tool_model's <tool_call>


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[str, str]:
    """(the eager caller's model folder, its tools.yaml)."""
    tmp = tmp_path_factory.mktemp("constrain")
    tools = tmp / "tools.yaml"
    tools.write_text(TOOLS)
    path = make_tool_model(resolve_model_path("builtin:tiny-random-llama"), tmp / "m")
    _eager_caller(path, tools)
    return path, str(tools)


def _eager_caller(path: str, tools: Path) -> None:
    """Tilt the (tied) embedding row of <tool_call> toward the last hidden state of a first assistant turn, so the
    random model starts a call there often (logit ~17 against ~12 for the best other token)."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    file = next(Path(path).glob("*.safetensors"))
    tensors = load_file(file)
    file.unlink()  # a link to the shared builtin model: written anew below
    ids = chat_ids(tok, [{"role": "user", "content": QUESTIONS[0]}], tools=load_tools(tools).schemas(),
                   add_generation_prompt=True)
    for _ in range(3):  # the prompt holds <tool_call> itself: settle the row against its own effect
        model.model.embed_tokens.weight.data = tensors["model.embed_tokens.weight"]
        with torch.no_grad():
            h = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        tensors["model.embed_tokens.weight"][TOOL_CALL_ID] = h * 17.0 / h.dot(h)
    save_file(tensors, file)


def _calls(out, prompt_messages: int) -> tuple[int, int]:
    """(malformed calls, well-formed calls) in a rollout's messages: a call the parser could not read stays in the
    assistant's text; a read one is in tool_calls and must validate against the tool's schema."""
    bad = good = 0
    for row in out.non_tensor_batch["messages"]:
        for m in row["messages"][prompt_messages:]:
            m = m if isinstance(m, dict) else m.model_dump()
            if m["role"] != "assistant":
                continue
            bad += (m.get("content") or "").count("<tool_call>")
            for call in m.get("tool_calls") or []:
                args = call["function"]["arguments"]
                try:
                    jsonschema.validate(json.loads(args) if isinstance(args, str) else args, ARGUMENTS)
                    good += 1
                except jsonschema.ValidationError:
                    bad += 1
    return bad, good


def _rollout(path: str, tools: str, constrain: bool, seed: int):
    from verl.workers.config import HFModelConfig

    config = rollout_config(temperature=1.0, response_length=48, prompt_length=512,
                            multi_turn={"tool_config_path": tools, "max_assistant_turns": 1,
                                        "tokenization_sanity_check_mode": "disable"})
    config.multi_turn.constrain_tool_calls = constrain  # what EngineConfig.rollout_config sets from config.yaml
    rollout = LocalRollout(config, HFModelConfig(path=path))
    try:
        tok = AutoTokenizer.from_pretrained(path)
        batch = chat_batch(tok, [[{"role": "user", "content": q}] for q in QUESTIONS], [{"add": {}}] * 4,
                           prompt_length=512, do_sample=True)
        return rollout.generate_sequences(batch, seed=seed)
    finally:
        rollout.shutdown()


@pytest.mark.parametrize("seed", [0, 1])
def test_constrained_rollouts_hold_no_malformed_call(setup, seed):
    path, tools = setup
    bad, _ = _calls(_rollout(path, tools, False, seed), 1)
    assert bad >= 1  # the eager caller writes garbage after <tool_call>
    bad, good = _calls(_rollout(path, tools, True, seed), 1)
    assert bad == 0 and good >= 1  # the same rows start calls, and every one parses and validates


def test_keywords_verl_drops_hold_too(setup, tmp_path):
    """veRL's schema model keeps a property's type, description and enum only; the constraint holds calls to the
    schema as tools.yaml wrote it (here a bound on each integer)."""
    path, _ = setup
    bounded = tmp_path / "tools.yaml"
    bounded.write_text(TOOLS.replace("type: integer, description: first number",
                                     "type: integer, minimum: 0, maximum: 9, description: first number")
                       .replace("type: integer, description: second number",
                                "type: integer, minimum: 0, maximum: 9, description: second number"))
    schema = load_tools(bounded).written["add"]["function"]["parameters"]
    assert schema["properties"]["a"]["maximum"] == 9  # kept as written
    assert "maximum" not in load_tools(bounded).schemas()[0]["function"]["parameters"]["properties"]["a"]  # veRL's
    calls = 0
    for seed in (0, 1):
        out = _rollout(path, str(bounded), True, seed)
        for row in out.non_tensor_batch["messages"]:
            for m in row["messages"][1:]:
                m = m if isinstance(m, dict) else m.model_dump()
                for call in (m.get("tool_calls") or []) if m["role"] == "assistant" else []:
                    args = call["function"]["arguments"]
                    jsonschema.validate(json.loads(args) if isinstance(args, str) else args, schema)
                    calls += 1
    assert calls >= 1


def test_a_tools_yaml_schema_that_is_not_json_schema(tmp_path):
    bad = tmp_path / "tools.yaml"
    bad.write_text(TOOLS.replace("required: [a, b]", "required: [a, b]\n          minProperties: many"))
    with pytest.raises(ToolConfigError, match=r"tools\[0\]\.tool_schema\.function\.parameters"):
        load_tools(bad)


def test_the_key_from_config_yaml(setup):
    path, tools = setup
    raw = {"model_path": path, "rollout": {"name": "local", "multi_turn": {
        "enable": True, "tool_config_path": tools, "constrain_tool_calls": True}}}
    config = load_config(raw).rollout_config()
    assert config.multi_turn.constrain_tool_calls is True and config.multi_turn.enable
    assert not hasattr(load_config({"model_path": path}).rollout_config().multi_turn, "constrain_tool_calls")
    raw["rollout"]["multi_turn"]["constrain_tool_calls"] = "yes"
    with pytest.raises(ConfigError, match="rollout.multi_turn.constrain_tool_calls"):
        load_config(raw)


def test_the_key_needs_tools(setup):
    from verl.workers.config import HFModelConfig

    path, _ = setup
    config = rollout_config(multi_turn={})
    config.multi_turn.constrain_tool_calls = True
    with pytest.raises(ToolConfigError, match="constrain_tool_calls"):
        LocalRollout(config, HFModelConfig(path=path))


def test_a_backend_without_constrained_decoding_refuses_the_key_at_start(setup):
    """The Tokasaurus backend (no constrained decoding over its protocol) refuses it before any request; nothing
    is contacted (the rollout checks at construction)."""
    from verl.workers.config import HFModelConfig

    from final.rollout.tokasaurus import TokasaurusRollout, TokasaurusSettings

    path, tools = setup
    config = rollout_config(multi_turn={"tool_config_path": tools})
    config.multi_turn.constrain_tool_calls = True
    with pytest.raises(ToolConfigError, match="rollout.multi_turn.constrain_tool_calls.*tokasaurus"):
        TokasaurusRollout(config, HFModelConfig(path=path), TokasaurusSettings(url="http://127.0.0.1:9"))
