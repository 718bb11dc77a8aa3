"""LocalRollout's multi-turn dispatch and InferenceEngine with tools: the multi-turn path behind the public API,
tools.yaml problems at start, progress and tool events per row."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from final.errors import ToolConfigError
from final.models import resolve_model_path
from final.rollout.local import LocalRollout
from multiturn_helpers import ScriptedEngine, chat_batch, make_tool_model, rollout_config

ROOT = Path(__file__).resolve().parents[1]
CALL = '<tool_call>\n{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tool_dir(tmp_path_factory) -> str:
    import verl.workers.rollout.schemas as schemas

    logging.getLogger(schemas.__file__).setLevel(logging.ERROR)
    return make_tool_model(resolve_model_path("builtin:tiny-random-llama"), tmp_path_factory.mktemp("tm") / "m")


def test_local_rollout_runs_the_multi_turn_path(tool_dir):
    from verl.workers.config import HFModelConfig

    tok = AutoTokenizer.from_pretrained(tool_dir)
    engine = ScriptedEngine(tok, {"ALPHA": ["Checking.\n" + CALL, "#### 72"], "BETA": ["#### 3"]})
    config = rollout_config(multi_turn={"tool_config_path": str(ROOT / "tools.yaml")})
    rollout = LocalRollout(config, HFModelConfig(path=tool_dir), engine=engine)
    done, events = [], []

    class Observer:  # final.rollout.base.Observer, per call
        row_done = staticmethod(lambda: done.append(1))
        tool_event = staticmethod(events.append)

    kwargs = [{"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}, {}]
    out = rollout.generate_sequences(chat_batch(tok, [[{"role": "user", "content": "ALPHA"}],
                                                      [{"role": "user", "content": "BETA"}]], kwargs),
                                     observer=Observer())
    assert set(out.non_tensor_batch) == {"messages", "reward_scores", "request_id"}
    assert out.non_tensor_batch["reward_scores"][0]["calc_gsm8k_reward"] == 1.0
    assert 0 in out.batch["response_mask"][0][: int(out.batch["attention_mask"][0, -128:].sum())].tolist()
    assert len(done) == 2  # the observer hears of each finished row
    assert [e["type"] for e in events if e["row"] == 0] == ["assistant", "tool_call", "tool_result", "assistant",
                                                            "done"]


def test_bad_tools_yaml_fails_at_start(tool_dir, tmp_path):
    from final.inf import InferenceEngine

    bad = tmp_path / "tools.yaml"
    bad.write_text("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: mcp}\n")
    for path, words in ((tmp_path / "missing.yaml", "not found"), (bad, "only 'native'")):
        config = {"model_path": tool_dir, "progress": False,
                  "rollout": {"name": "local", "prompt_length": 512, "response_length": 16,
                              "multi_turn": {"enable": True, "tool_config_path": str(path)}}}
        with pytest.raises(ToolConfigError, match=words):
            InferenceEngine(config)


def test_inference_engine_with_tools_on_the_embedded_engine(tool_dir):
    from final.inf import InferenceEngine

    config = {"model_path": tool_dir, "progress": False,
              "rollout": {"name": "local", "prompt_length": 512, "response_length": 24,
                          "multi_turn": {"enable": True, "tool_config_path": str(ROOT / "tools.yaml")}}}
    with InferenceEngine(config) as engine:
        kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}
        out = engine.generate([[{"role": "user", "content": "Natalia sold 48 clips. How many?"}], "Hi"],
                              tools_kwargs=kwargs, temperature=0)
        assert len(out.completions) == 2
        assert all(len(m["response_mask"]) == len(m["response_ids"]) > 0 for m in out.metadata)
        again = engine.generate("Hi", tools_kwargs=kwargs, temperature=0)  # the engine keeps serving
        assert again.token_ids[0] == out.token_ids[1]


def test_generation_output_carries_the_conversation(tool_dir):
    """GenerationOutput rows of a tool-calling run: final answer, full messages with the call, rewards, turns."""
    from final.inf import InferenceEngine

    config = {"model_path": tool_dir, "progress": False,
              "rollout": {"name": "local", "prompt_length": 512, "response_length": 64,
                          "multi_turn": {"enable": True, "tool_config_path": str(ROOT / "tools.yaml")}}}
    with InferenceEngine(config) as engine:
        # the model is scripted at the engine boundary: it calls the tool, then answers
        engine.rollout.multi_turn.engine = ScriptedEngine(engine.tokenizer, {"ALPHA": ["Checking.\n" + CALL,
                                                                                        "#### 72"]})
        out = engine.generate("ALPHA", tools_kwargs={"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}})
    meta = out.metadata[0]
    assert out.completions[0] == "#### 72"
    assert [m["role"] for m in meta["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert meta["messages"][1]["tool_calls"] == [{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}]
    # two assistant turns even though the 64-token response tensor (veRL's finalize truncates it) ends mid-way
    assert meta["rewards"]["calc_gsm8k_reward"] == 1.0 and meta["num_turns"] == 2
    assert 0 in meta["response_mask"] and meta["completion_tokens"] == sum(meta["response_mask"])
