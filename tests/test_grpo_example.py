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
