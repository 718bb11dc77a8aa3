"""InferenceEngine on the SGLang backend (the real SGLang 0.5.2 on CPU, tests/sglang_cpu): the same front door as
every backend. Tools of tools.yaml are offered by default, what SGLang cannot serve is refused before any work,
each row carries the engine's record, and `final eval gsm8k --config ...` runs it through InferenceEngine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sglang_helpers import CPU_ARGS, TINY, use_sglang_cpu
from final.errors import SamplingError, UnsupportedError

ROOT = Path(__file__).resolve().parents[1]


def sglang_config(model: str = TINY, **rollout) -> dict:
    return {"model_path": model, "progress": False, "rollout": {
        "name": "sglang", "dtype": "float32", "prompt_length": 256, "response_length": 12,
        "engine_kwargs": {"sglang": dict(CPU_ARGS)}, **rollout}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    use_sglang_cpu()
    from final.inf import InferenceEngine
    from final.models import resolve_model_path
    from multiturn_helpers import make_tool_model

    # veRL's SGLangRollout picks its tool-call parser from the vocabulary: a model with <tool_call> tokens
    model = make_tool_model(resolve_model_path(TINY), tmp_path_factory.mktemp("tm") / "m")
    tools = {"enable": True, "tool_config_path": str(ROOT / "tools.yaml"), "tokenization_sanity_check_mode": "disable"}
    with InferenceEngine(sglang_config(model, multi_turn=tools, calculate_log_probs=False)) as eng:
        yield eng


def test_tools_of_tools_yaml_are_offered_by_default(engine):
    assert engine.backend == "sglang" and engine.tool_names() == ["calc_gsm8k_reward"]
    assert engine.prepare("What is 2+2?").tools_kwargs == [{"calc_gsm8k_reward": {}}]
    out = engine.generate("What is 2+2?", temperature=0, max_tokens=8)
    meta = out.metadata[0]
    assert meta["messages"][0] == {"role": "user", "content": "What is 2+2?"} and meta["num_turns"] >= 1
    assert meta["finish_reason"] in ("stop", "length") and meta["prompt_tokens"] > 0


def test_what_sglang_cannot_serve_is_refused_before_any_work(engine):
    with pytest.raises(UnsupportedError, match="random_seed") as exc:
        engine.generate("hi", seed=1)
    assert exc.value.backend == "sglang" and exc.value.field == "seed"
    assert engine.generate("hi", temperature=0, max_tokens=2).completions  # still serving


def test_a_calls_own_tools_are_offered_in_one_turn_and_not_run(engine):
    """generate(tools=[...]) on veRL 0.6.0's SGLangRollout: the tools rendered by the model's template, one turn on
    veRL's batch path although tools.yaml's loop is on, the row read into an OpenAI message; max_turns (running the
    call's own tools) is refused naming the backend and the field: veRL builds its tools when it starts."""
    from tools_helpers import get_weather

    request = engine.prepare("What is the weather in Oslo?", tools=[get_weather])
    assert request.tools_kwargs is None and '"name": "get_weather"' in engine.tokenizer.decode(request.ids[0])
    out = engine.generate("What is the weather in Oslo?", tools=[get_weather], temperature=0, max_tokens=8)
    meta = out.metadata[0]
    assert "messages" not in meta and meta["message"]["role"] == "assistant" and meta["completion_tokens"] > 0
    with pytest.raises(UnsupportedError) as exc:
        engine.prepare("What is the weather in Oslo?", tools=[get_weather], max_turns=2)
    assert exc.value.backend == "sglang" and exc.value.field == "max_turns" and "tool_config_path" in str(exc.value)
    for kwargs, field in [({"tool_choice": "required"}, "tool_choice"),
                          ({"response_format": {"type": "json_object"}, "tools": None}, "response_format")]:
        with pytest.raises(UnsupportedError) as exc:  # the constraint it needs, refused as the caller asked for it
            engine.prepare("What is the weather in Oslo?", **{"tools": [get_weather], **kwargs})
        assert exc.value.backend == "sglang" and exc.value.field == field and "constrained" in str(exc.value)


def test_scoring_takes_veRLs_batch_path_where_tools_are_on(engine):
    """A scoring call is one forward pass per row, not a conversation: veRL's batch path even in multi-turn mode."""
    [score] = engine.score("What is 2+2?", " 4", top_logprobs=2)
    assert len(score.continuation_logprobs) == len(score.continuation_ids) == 2
    assert score.prompt_logprobs[0] is None and all(v < 0 for v in score.prompt_logprobs[1:])
    with pytest.raises(SamplingError, match="single-turn"):
        engine.generate("What is 2+2?", prompt_logprobs=True, max_tokens=2)


def test_eval_runs_the_sglang_backend_through_inference_engine(tmp_path, capsys):
    use_sglang_cpu()
    from final import cli

    config = tmp_path / "sglang.yaml"
    from final.models import resolve_model_path
    from multiturn_helpers import make_tool_model

    config.write_text(yaml.safe_dump(sglang_config(make_tool_model(resolve_model_path(TINY), tmp_path / "m"))))
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"Ann has {i} pens and buys {i} more. How many?",
                                        "answer": f"#### {2 * i}"}) + "\n" for i in range(2)))
    out = tmp_path / "r.jsonl"
    assert cli.main(["eval", "gsm8k", "--config", str(config), "--data", str(data), "--limit", "2", "--tools",
                     str(ROOT / "tools.yaml"), "--max-assistant-turns", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "backend: sglang" in printed and "tools                          yes" in printed
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0, 1]


def test_eval_with_a_tool_cartridge_calls_the_tool_on_sglang(tmp_path, capsys):
    """Issue 28: a tool-use cartridge trained through `final cartridge traces` + `train` (on the embedded path's
    tokens) makes the random tool model call calc_gsm8k_reward under veRL's own SGLangRollout loop too, and
    `final eval gsm8k --cartridge` completes there."""
    use_sglang_cpu()
    from final import cli
    from final.models import resolve_model_path
    from multiturn_helpers import make_tool_model, train_tool_cartridge

    model = make_tool_model(resolve_model_path(TINY), tmp_path / "m")
    cartridge, data = train_tool_cartridge(model, ROOT / "tools.yaml", tmp_path)
    config = tmp_path / "sglang.yaml"
    config.write_text(yaml.safe_dump(sglang_config(model, prompt_length=512, response_length=128)))
    out = tmp_path / "r.jsonl"
    assert cli.main(["eval", "gsm8k", "--config", str(config), "--data", str(data), "--tools", str(ROOT / "tools.yaml"),
                     "--cartridge", str(cartridge), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "backend: sglang" in printed and "tool-call rate                 1.000" in printed
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(c["name"], c["arguments"]) for c in record["tool_calls"]] == [("calc_gsm8k_reward", {"answer": "7"})]
    assert record["score"] == 1.0
