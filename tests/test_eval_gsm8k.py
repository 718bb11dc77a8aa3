"""`final eval gsm8k` (final/evals/): data loading, veRL's prompts and scorer, the summary, the per-problem JSONL,
and the command end to end on the embedded engine."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from final.errors import ConfigError, PromptError
from final.evals import gsm8k
from final.tools import gsm8k_task
from final.models import resolve_model_path
from final.rollout.multi_turn import MultiTurnRollout
from multiturn_helpers import ScriptedEngine, generate_fn, make_tool_model, rollout_config

ROOT = Path(__file__).resolve().parents[1]
PROBLEMS = [
    {"question": "Janet has 16 eggs and eats 3. How many are left?", "answer": "16 - 3 = 13\n#### 13"},
    {"question": "Sam has 1,200 coins and finds 300 more. How many now?", "answer": "1200 + 300\n#### 1,500"},
    {"question": "Zed has 2 apples. How many?", "answer": "He has 2\n#### 2"},
]


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return path


def test_load_problems(data, tmp_path):
    problems = gsm8k.load_problems(data)
    assert [(p.index, p.ground_truth) for p in problems] == [(0, "13"), (1, "1500"), (2, "2")]
    assert len(gsm8k.load_problems(data, limit=2)) == 2
    with pytest.raises(ConfigError, match="not found"):
        gsm8k.load_problems(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError) as err:
        gsm8k.load_problems(data, limit=0)
    assert err.value.key == "--limit"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PROBLEMS[0]) + "\n{not json\n")
    with pytest.raises(PromptError) as err:
        gsm8k.load_problems(bad)
    assert err.value.index == 1 and "line 2" in str(err.value)
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(PromptError, match="#### <number>"):
        gsm8k.load_problems(bad)


def test_prompts_follow_verl_preprocessing():
    smol = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-random-llama"))
    schemas = [{"type": "function", "function": {"name": "calc_gsm8k_reward", "description": "d",
                                                 "parameters": {"type": "object", "properties": {}, "required": []}}}]
    problem = gsm8k.Problem(0, "What is 2+2?", "#### 4", "4")
    assert gsm8k.build_messages(problem, None, False) == [
        {"role": "user", "content": 'What is 2+2? Let\'s think step by step and output the final answer after "####".'}]
    assert not gsm8k.template_renders_tools(smol, schemas)  # SmolLM2's template drops `tools`...
    system, user = gsm8k.build_messages(problem, schemas, False)
    assert system["content"].startswith(gsm8k_task.TOOL_SYSTEM) and '"name": "calc_gsm8k_reward"' in system["content"]
    assert "<tool_call>" in system["content"]  # ...so the tool is described in the system message
    assert user["content"].endswith("after `####`.")
    assert gsm8k.build_messages(problem, schemas, True)[0]["content"] == gsm8k_task.TOOL_SYSTEM


def test_evaluate_scores_with_verl_and_writes_jsonl(data, tmp_path):
    import verl.workers.rollout.schemas as schemas

    logging.getLogger(schemas.__file__).setLevel(logging.ERROR)
    tok = AutoTokenizer.from_pretrained(make_tool_model(resolve_model_path("builtin:tiny-random-llama"),
                                                        tmp_path / "m"))
    call = '<tool_call>\n{{"name": "calc_gsm8k_reward", "arguments": {{"answer": "{}"}}}}\n</tool_call>'
    script = {"Janet": ["16 - 3 = 13\n" + call.format("13"), "#### 13"],  # right, checked with the tool
              "Sam": [call.format("1400"), "#### 1400"],                    # wrong, checked with the tool
              "Zed": ["The answer is 2"]}                                   # no tool, no '####': strict miss
    rollout = MultiTurnRollout(ScriptedEngine(tok, script),
                               rollout_config(multi_turn={"tool_config_path": str(ROOT / "tools.yaml")},
                                              prompt_length=1024, response_length=256), tok)

    generate = generate_fn(rollout, tok)  # what InferenceEngine.generate does for a multi-turn call
    out = tmp_path / "results.jsonl"
    problems = gsm8k.load_problems(data)
    summary = gsm8k.evaluate(generate, problems, rollout.tools.schemas(), True, batch_size=2, out_path=out)
    assert summary["problems"] == 3 and summary["tools"]
    assert summary["accuracy"] == pytest.approx(1 / 3)  # strict: only Janet's "#### 13"
    assert summary["flexible_accuracy"] == pytest.approx(2 / 3)  # flexible also takes Zed's last number
    assert summary["tool_call_rate"] == pytest.approx(2 / 3) and summary["mean_tool_calls"] == pytest.approx(2 / 3)
    assert summary["mean_turns"] == pytest.approx(5 / 3)
    assert summary["mean_tool_reward"] == pytest.approx(1 / 3)  # Gsm8kTool.calc_reward: Janet's submission
    assert summary["completion_tokens"] > 0 and summary["tokens_per_s"] > 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["score"], r["num_turns"], len(r["tool_calls"])) for r in records] == [
        (0, 1.0, 2, 1), (1, 0.0, 2, 1), (2, 0.0, 1, 0)]
    assert records[0]["tool_calls"][0]["arguments"] == {"answer": "13"}
    assert records[0]["tool_calls"][0]["response"] == "Current parsed answer='13' reward=1.0"
    assert records[1]["messages"][2]["tool_calls"][0]["name"] == "calc_gsm8k_reward"
    table = gsm8k.format_table(summary)
    assert "accuracy (veRL gsm8k, strict)  0.333" in table and "tool-call rate" in table


def test_command_end_to_end_on_the_embedded_engine(data, tmp_path, capsys, monkeypatch):
    from final import cli

    if "final.evals.cli" not in cli.SUBCOMMAND_MODULES:  # `final eval` registers like the other feature commands
        monkeypatch.setattr(cli, "SUBCOMMAND_MODULES", [*cli.SUBCOMMAND_MODULES, "final.evals.cli"])
    out = tmp_path / "r.jsonl"
    args = ["eval", "gsm8k", "--data", str(data), "--limit", "2", "--model", "builtin:tiny-random-llama",
            "--prompt-length", "512", "--response-length", "8", "--max-assistant-turns", "2",
            "--tools", str(ROOT / "tools.yaml"), "--out", str(out)]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "tools                          yes" in printed and f"per-problem results: {out}" in printed
    assert len(out.read_text().splitlines()) == 2
    assert cli.main([*args[:4], "--batch-size", "0"]) == 2  # typed error, printed, exit status 2
    assert "key '--batch-size'" in capsys.readouterr().err
    assert cli.main([*args[:4], "--tools", str(tmp_path / "none.yaml")]) == 2
    assert "tool config file not found" in capsys.readouterr().err


def test_constraint_flag_constrains_every_answer(data, tmp_path, capsys, monkeypatch):
    """--constraint KEY=FILE: every answer follows the grammar (here a regex the strict scorer can read)."""
    from final import cli

    if "final.evals.cli" not in cli.SUBCOMMAND_MODULES:
        monkeypatch.setattr(cli, "SUBCOMMAND_MODULES", [*cli.SUBCOMMAND_MODULES, "final.evals.cli"])
    pattern = tmp_path / "answer.regex"
    pattern.write_text("#### [0-9]{1,2}\n")
    out = tmp_path / "r.jsonl"
    args = ["eval", "gsm8k", "--data", str(data), "--model", "builtin:tiny-random-llama", "--prompt-length", "512",
            "--response-length", "8", "--out", str(out), "--constraint", f"regex={pattern}"]
    assert cli.main(args) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3 and all(r["extracted"] == r["response"][5:] for r in records)
    assert cli.main([*args[:-1], f"regex={tmp_path / 'missing'}"]) == 2
    assert "key '--constraint'" in capsys.readouterr().err
    assert cli.main([*args[:-1], f"grammar={pattern}"]) == 2
    assert "json_schema, regex, ebnf, structural_tag" in capsys.readouterr().err
