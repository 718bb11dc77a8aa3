"""examples/grpo.py end to end on the tiny model: rollouts from InferenceEngine.generate, an Adam step on the HF
policy, the full weights into the engine after every step, and the trained policy saved and served again."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY

REPO = Path(__file__).resolve().parents[1]


def load_example():
    if str(REPO / "examples") not in sys.path:  # grpo.py imports grpo_tools from its own folder, as a script does
        sys.path.insert(0, str(REPO / "examples"))
    spec = importlib.util.spec_from_file_location("grpo_example", REPO / "examples" / "grpo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    yield 1  # a tiny model's OpenMP regions only wait for each other on busy cores
    torch.set_num_threads(before)


def odd_length(text: str, answer: str) -> float:
    """A rule with spread on a random model's output (it never writes "#### N"), so groups carry signal."""
    return float(len(text) % 2)


def test_grpo_two_steps_sync_versions_and_save(tmp_path, one_thread):
    grpo = load_example()
    result = grpo.main(["--model", TINY, "--steps", "2", "--prompts", "2", "--n", "4", "--max-tokens", "8",
                        "--eval-problems", "6", "--lr", "1e-3", "--kl-coef", "0.05", "--threads", str(one_thread),
                        "--out", str(tmp_path)], reward=odd_length)
    history = result["history"]
    # rows of step 1 came from version 0, step 2's from version 1; the last update made version 2
    assert [h["version"] for h in history] == [0, 1]
    assert [h["new_version"] for h in history] == [1, 2]
    # the engine's logprobs of step 2's samples match the policy after step 1's large step: it serves those
    # weights (without the update the gap is ~0.25 nats here)
    assert all(h["live_groups"] > 0 for h in history)
    assert history[1]["gap"] < 1e-3 and history[1]["grad_norm"] > 0
    assert len(result["held_out_after"]) == 6 and all(math.isfinite(x) for x in result["difference"])
    assert Path(result["png"]).stat().st_size > 0

    from final.inf import InferenceEngine

    policy = Path(result["policy"])
    assert list(policy.glob("*.safetensors")) and (policy / "tokenizer.json").exists()
    with InferenceEngine({"model_path": str(policy), "progress": False,
                          "rollout": {"name": "local", "prompt_length": 64, "response_length": 8}}) as engine:
        out = engine.generate("What is 2 + 3?", temperature=0, max_tokens=4)
        assert out.metadata[0]["completion_tokens"] > 0 and out.metadata[0]["weights_version"] == 0


def test_tool_mode_trains_on_the_policy_tokens_of_conversations(tmp_path, one_thread):
    grpo = load_example()
    result = grpo.main(["--model", TINY, "--tools", "--constrain-calls", "--steps", "2", "--prompts", "2", "--n", "4",
                        "--max-tokens", "24", "--eval-problems", "4", "--lr", "1e-3", "--threads", str(one_thread),
                        "--out", str(tmp_path)], reward=odd_length)
    history = result["history"]
    assert [h["version"] for h in history] == [0, 1] and [h["new_version"] for h in history] == [1, 2]
    assert all(h["live_groups"] > 0 and h["grad_norm"] > 0 for h in history)
    assert all(math.isnan(h["gap"]) for h in history)  # no engine logprobs in a multi-turn rollout: nothing to compare
    assert all({"calls", "malformed_calls", "rows_calling", "turns"} <= set(h) for h in history)
    assert "final.tools.calculator.CalculatorTool" in (tmp_path / "tools.yaml").read_text()
    assert len(result["held_out_after"]) == 4


def test_tool_rows_are_read_as_the_loop_reads_them():
    """The loop's trace for the turns it ran (an error: unreadable or no such tool; arguments off the calculator's
    schema: malformed too), the last turn's text for calls it never ran."""
    import grpo_tools
    from final.tools.parser import ToolCallParser

    def turn(body: str) -> dict:
        return {"role": "assistant", "content": f"Let me compute.\n<tool_call>\n{body}\n</tool_call>"}

    def ran(index: int, arguments: dict, response: str, name: str = "calculator", error: str | None = None) -> dict:
        return {"turn": 1, "name": name, "arguments": arguments, "response": response, "error": error,
                "message_index": index}

    row = {"messages": [{"role": "system", "content": "tools"}, {"role": "user", "content": "q"},
                        {"role": "assistant", "content": "Let me compute."}, {"role": "tool", "content": "1776"},
                        turn('{"name": "calculator", "arguments": {"expr'), {"role": "tool", "content": "Error"},
                        turn('{"name": "calculator", "arguments": {"expression": "1 + 1"}}')],
           "tool_calls": [ran(2, {"expression": "37 * 48"}, "1776"), ran(2, {"expression": "37 = 48"}, "error: x"),
                          ran(4, None, "Error: bad JSON", name=None, error="invalid JSON"),
                          ran(4, {"expression": "1"}, "Error: unknown tool", name="calc", error="unknown tool"),
                          {"name": "calculator", "stage": "release", "error": "finish errors are not calls"}]}
    parser = ToolCallParser("hermes")
    assert grpo_tools.call_counts(row, parser) == (3, 5)  # 37 = 48 fails the pattern; the last turn's call is good
    assert grpo_tools.calculated(row)
    row["tool_calls"] = row["tool_calls"][1:]
    assert not grpo_tools.calculated(row)  # the calculator only answered "error: ..."
    row["messages"][-1] = turn('{"name": "calculator", "arguments": {"expression": 7}}')
    assert grpo_tools.call_counts(row, parser) == (4, 4)


def test_tool_problems_need_the_calculator():
    grpo = load_example()
    import grpo_tools

    held, _ = grpo.problem_sets(0, 30, lambda rng: grpo.Problem(*grpo_tools.make_problem(rng)))
    for p in held:
        numbers = [int(w) for w in p.question.replace("?", " ").split() if w.isdigit()]
        assert len(numbers) == 2 and all(n >= 12 for n in numbers)
        assert int(p.answer) >= 50 and int(p.answer) not in numbers


def test_problem_sets_keep_held_out_apart():
    grpo = load_example()
    held, train = grpo.problem_sets(seed=3, held_out=50)
    questions = {p.question for p in held}
    assert len(questions) == 50
    assert not questions & {next(train).question for _ in range(500)}


def test_bootstrap_interval_brackets_the_mean():
    grpo = load_example()
    diff, lo, hi = grpo.bootstrap_diff([0, 0, 0, 1] * 25, [1, 0, 1, 1] * 25)
    assert diff == pytest.approx(0.5) and lo < 0.5 < hi and lo > 0
