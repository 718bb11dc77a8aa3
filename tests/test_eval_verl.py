"""`final eval verl` (final/evals/verl_*.py, runner.py): a veRL RL-dataset parquet written as veRL's
examples/data_preprocess/gsm8k_multiturn_w_tool.py writes it (from the shared GSM8K file) plus a second data source
scored by a custom reward function file; prompts rendered as veRL's RLHFDataset renders them; metrics equal to
veRL's process_validation_metrics on the per-sample file; multi-turn rows run the real tool; typed errors before
any generation; resume; `final eval gsm8k` as a preset of the same path."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from conftest import TINY, tiny_config
from final.compat import LANE, REWARD_NUMBER_AS_ACC
from final.errors import ConfigError, DataError
from final.evals import verl_config, verl_eval
from final.evals import verl_data
from final.evals.verl_data import load_rows, render
from final.evals.verl_reward import load_scorer, name_metrics

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools.yaml"
GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"
if not GSM8K.is_file():  # a worktree beside the main checkout
    GSM8K = Path("/work/shared/data/gsm8k/test.jsonl")
ARITH = [("What is 2 + 3?", "5"), ("What is 7 * 6?", "42")]
REWARD = '''
from verl.utils.reward_score import default_compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    words = solution_str.split()
    pred = words[-1] if words else ""
    if data_source == "final/arith":
        score = float(pred == ground_truth) + bonus
    else:
        score = default_compute_score(data_source, solution_str, ground_truth, extra_info)
    tool_reward = float((extra_info["rollout_reward_scores"] or {}).get("calc_gsm8k_reward", 0.0))
    return {"score": score, "pred": pred, "chars": len(solution_str), "tool_reward": tool_reward}
'''


def gsm8k_multiturn_w_tool(path: Path, count: int = 3) -> Path:
    """veRL's examples/data_preprocess/gsm8k_multiturn_w_tool.py on the first `count` problems of the shared file."""
    problems = [json.loads(line) for line in GSM8K.read_text().splitlines()[:count]]
    return verl_data.write_parquet(path, verl_data.gsm8k_multiturn_w_tool(problems))


write_parquet = verl_data.write_parquet


def arith_rows() -> list[dict]:
    return [{"data_source": "final/arith", "prompt": [{"role": "user", "content": q}], "ability": "arith",
             "reward_model": {"style": "rule", "ground_truth": a}, "extra_info": {"index": i}}
            for i, (q, a) in enumerate(ARITH)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("verl_data")
    (tmp / "reward.py").write_text(REWARD)
    return {"gsm8k": gsm8k_multiturn_w_tool(tmp / "gsm8k.parquet"), "arith": write_parquet(tmp / "arith.parquet",
                                                                                            arith_rows()),
            "reward": tmp / "reward.py", "tmp": tmp}


def tool_engine_config(**rollout) -> dict:
    config = tiny_config(prompt_length=512, response_length=8, calculate_log_probs=False, **rollout)
    config["rollout"]["multi_turn"] = {"enable": True, "tool_config_path": str(TOOLS), "max_assistant_turns": 2,
                                       "tokenization_sanity_check_mode": "disable"}
    return config


@pytest.fixture(scope="module")
def engine():
    from final.inf import InferenceEngine

    with InferenceEngine(tool_engine_config()) as e:
        yield e


def verl_metrics_of(records: list[dict]) -> dict:
    """What veRL's trainer computes from a per-sample file: process_validation_metrics over the rows' scores and
    reward extra info, grouped by data source and prompt."""
    from verl.trainer.ppo.metric_utils import process_validation_metrics

    infos = {"reward": [r["score"] for r in records]}
    for key in records[0]["reward_extra_info"]:
        infos[key] = [r["reward_extra_info"][key] for r in records]
    return name_metrics(process_validation_metrics([r["data_source"] for r in records],
                                                   [str(r["row"]) for r in records], infos))


def test_command_metrics_equal_verl_process_validation_metrics(data, tmp_path, capsys, monkeypatch):
    from final import cli

    if "final.evals.cli" not in cli.SUBCOMMAND_MODULES:
        monkeypatch.setattr(cli, "SUBCOMMAND_MODULES", [*cli.SUBCOMMAND_MODULES, "final.evals.cli"])
    config = tmp_path / "tiny.yaml"
    config.write_text(json.dumps(tiny_config()))
    out = tmp_path / "samples.jsonl"
    args = ["eval", "verl", "--config", str(config), "--data", str(data["gsm8k"]), "--data", str(data["arith"]),
            "--tools", str(TOOLS), "--reward-fn", str(data["reward"]), "--seed", "3", "--out", str(out),
            "data.max_response_length=6", "actor_rollout_ref.rollout.val_kwargs.n=2",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
            "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
            "+custom_reward_function.reward_kwargs={bonus: 0.5}"]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["row"], r["sample"]) for r in records] == [(i, s) for i in range(5) for s in range(2)]
    assert {r["data_source"] for r in records} == {"openai/gsm8k", "final/arith"}
    saved = json.loads(out.with_suffix(".metrics.json").read_text())
    metrics = saved["metrics"]
    assert metrics == verl_metrics_of(records)
    for var in ("reward", "score", "chars", "tool_reward"):
        assert f"val-aux/final/arith/{var}/std@2" in metrics or var == "reward"
    assert {"val-core/final/arith/reward/mean@2", "val-core/openai/gsm8k/reward/best@2/mean",
            "val-core/final/arith/reward/maj@2/mean", "val-aux/openai/gsm8k/chars/mean@2"} <= set(metrics)
    # reward_kwargs reach the function (a wrong arith answer still scores the bonus)
    assert all(r["score"] >= 0.5 for r in records if r["data_source"] == "final/arith")
    assert metrics["val-core/final/arith/reward/mean@2"] >= 0.5
    assert "val-core/final/arith/reward/mean@2" in printed and f"per-sample results: {out}" in printed
    assert saved["summary"]["samples"] == 10 and saved["summary"]["rows"] == 5
    assert records[0]["messages"][0]["role"] == "system" and records[0]["finish_reason"] in ("stop", "length")
    assert records[0]["completion_tokens"] <= 6 and records[0]["tool_rewards"]["calc_gsm8k_reward"] == 0.0


def scripted_generate(tmp_path: Path):
    """generate(messages, tools_kwargs) as InferenceEngine.generate runs a multi-turn call, over veRL's
    multi-turn state machine (final/rollout/multi_turn.py) with the real Gsm8kTool and scripted model turns."""
    import verl.workers.rollout.schemas as schemas
    from transformers import AutoTokenizer

    from final.models import resolve_model_path
    from final.rollout.multi_turn import MultiTurnRollout
    from multiturn_helpers import ScriptedEngine, generate_fn, make_tool_model, rollout_config

    logging.getLogger(schemas.__file__).setLevel(logging.ERROR)
    tok = AutoTokenizer.from_pretrained(make_tool_model(resolve_model_path(TINY), tmp_path / "m"))
    call = '<tool_call>\n{{"name": "calc_gsm8k_reward", "arguments": {{"answer": "{}"}}}}\n</tool_call>'
    script = {"Janet": ["16 - 3 - 4 = 9 and 9 * 2 = 18\n" + call.format("18"), "#### 18"],  # right, checked
              "robe": [call.format("4"), "#### 4"],  # wrong, checked
              "Josh": ["#### 70000"],  # right, no tool
              "2 + 3": ["It is 5"], "7 * 6": ["It is 41"]}
    rollout = MultiTurnRollout(ScriptedEngine(tok, script), rollout_config(
        multi_turn={"tool_config_path": str(TOOLS)}, prompt_length=1024, response_length=256), tok)
    return generate_fn(rollout, tok), tok


def test_multi_turn_rows_run_the_real_tool_and_feed_the_reward(data, tmp_path):
    from final.evals.runner import CallableGenerator, run_rows
    from final.evals.verl_reward import validation_metrics

    generate, tok = scripted_generate(tmp_path)
    rows = load_rows([str(data["gsm8k"]), str(data["arith"])])
    kept, dropped = render(rows, tok, 1024)
    assert len(kept) == 5 and not dropped
    scorer = load_scorer({"path": str(data["reward"]), "name": "compute_score", "reward_kwargs": {}})
    run = run_rows(kept, CallableGenerator(generate), scorer, tok, multi_turn=True, out_path=tmp_path / "s.jsonl")
    janet, robe, josh, add, mul = run.records
    [checked] = janet["tool_calls"]
    assert checked["arguments"] == {"answer": "18"} and checked["response"] == "Current parsed answer='18' reward=1.0"
    assert "Current parsed answer='18' reward=1.0" in janet["response"] and janet["num_turns"] == 2
    assert janet["tool_rewards"]["calc_gsm8k_reward"] == 1.0 and robe["tool_rewards"]["calc_gsm8k_reward"] == 0.0
    assert [r["score"] for r in run.records] == [1.0, 0.0, 1.0, 1.0, 0.0]  # veRL's gsm8k scorer; the custom one
    assert (josh["tool_calls"], add["tool_calls"], add["num_turns"]) == ([], [], 1)
    assert mul["reward_extra_info"]["pred"] == "41" and janet["reward_extra_info"]["tool_reward"] == 1.0
    metrics = validation_metrics(run.records)
    assert metrics["val-core/openai/gsm8k/reward/mean@1"] == pytest.approx(2 / 3)
    assert metrics["val-aux/openai/gsm8k/tool_reward/mean@1"] == pytest.approx(1 / 3)
    assert metrics["val-core/final/arith/reward/mean@1"] == 0.5
    assert metrics == verl_metrics_of([json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()])


@pytest.mark.skipif(LANE != "verl06", reason="veRL 0.9's RLHFDataset returns the messages; its agent loop renders")
def test_prompts_are_rlhf_datasets_raw_prompt_ids(data, tmp_path, monkeypatch, tiny_tokenizer):
    """veRL's own RLHFDataset on the same parquet: the same raw_prompt_ids, with a chat template given in
    apply_chat_template_kwargs and middle truncation."""
    import datasets
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    conf = {"max_prompt_length": 48, "truncation": "middle", "filter_overlong_prompts": False,
            "apply_chat_template_kwargs": {"chat_template": template}, "cache_dir": str(tmp_path / "verl")}
    dataset = RLHFDataset([str(data["gsm8k"]), str(data["arith"])], tiny_tokenizer, OmegaConf.create(conf))
    kept, _ = render(load_rows([str(data["gsm8k"]), str(data["arith"])]), tiny_tokenizer, 48, "middle",
                     chat_kwargs={"chat_template": template})
    assert [r.prompt_ids for r in kept] == [list(dataset[i]["raw_prompt_ids"]) for i in range(len(dataset))]
    assert len(kept[0].prompt_ids) == 48 and len(kept[-1].prompt_ids) < 48
    # veRL's None for a row whose file has no tools_kwargs (its multi-turn path would crash on it) is no tools here
    assert [dataset[i]["tools_kwargs"] or {} for i in range(len(dataset))] == [r.tools_kwargs for r in kept]
    kept, dropped = render(load_rows([str(data["gsm8k"]), str(data["arith"])]), tiny_tokenizer, 48,
                           filter_overlong=True)
    assert len(kept) == 2 and len(dropped) == 3  # filter_overlong_prompts: the GSM8K prompts are longer


def test_verl_config_composes_over_ppo_trainer(data, tmp_path):
    example = tmp_path / "gsm8k_multiturn.yaml"  # veRL's examples/sglang_multiturn/config layout
    example.write_text(f"""
hydra:
  searchpath:
    - file://verl/trainer/config
defaults:
  - ppo_trainer
  - _self_
data:
  val_files: {data['gsm8k']}
  max_prompt_length: 300
  return_raw_chat: true
actor_rollout_ref:
  rollout:
    val_kwargs: {{n: 3, do_sample: true, temperature: 0.7}}
    multi_turn: {{enable: true, max_assistant_turns: 4, tool_config_path: {TOOLS}}}
custom_reward_function:
  path: {data['reward']}
""")
    s = verl_config.settings(verl_config.compose(example, ["data.max_response_length=64",
                                                           "actor_rollout_ref.rollout.val_kwargs.top_p=0.9"]))
    assert s.val_files == [str(data["gsm8k"])] and s.max_prompt_length == 300 and s.response_length == 64
    assert s.val_kwargs["n"] == 3 and s.val_kwargs["top_p"] == 0.9 and s.truncation == "error"
    assert s.multi_turn["max_assistant_turns"] == 4 and s.tools_enabled
    assert s.custom_reward["path"] == str(data["reward"]) and s.custom_reward["name"] == "compute_score"
    sampling = verl_eval.sampling_of(s, seed=1)
    assert sampling == {"n": 3, "max_tokens": 64, "do_sample": True, "temperature": 0.7, "top_k": -1, "top_p": 0.9,
                        "seed": 1}
    partial = tmp_path / "partial.yaml"  # no defaults list: put over ppo_trainer.yaml
    partial.write_text("data:\n  max_prompt_length: 100\n  truncation: left\n")
    s = verl_config.settings(verl_config.compose(partial), data=[str(data["arith"])])
    assert (s.max_prompt_length, s.truncation, s.response_length, s.val_kwargs["do_sample"]) == (100, "left", 512,
                                                                                                 False)
    assert verl_eval.sampling_of(s) == {"n": 1, "max_tokens": 512, "do_sample": False}
    with pytest.raises(ConfigError) as err:
        verl_config.compose(None, ["data.no_such_key=1"])
    assert err.value.key == "overrides" and "no_such_key" in str(err.value)


def test_bad_input_is_a_typed_error_before_any_generation(data, tmp_path, engine):
    out = tmp_path / "never.jsonl"
    run = dict(engine=engine, out=str(out), overrides=["data.max_response_length=8"])
    bad = write_parquet(tmp_path / "no_reward.parquet", [{"data_source": "final/arith", "prompt": [
        {"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError) as err:
        verl_eval.evaluate_verl(str(bad), **run)
    assert err.value.column == "reward_model" and err.value.path == str(bad)
    with pytest.raises(DataError) as err:  # no scorer in veRL's default_compute_score, no custom function
        verl_eval.evaluate_verl([str(data["gsm8k"]), str(data["arith"])], **run)
    assert (err.value.path, err.value.row, err.value.column) == (str(data["arith"]), 0, "data_source")
    assert "final/arith" in str(err.value)
    rows = arith_rows()
    rows[1]["extra_info"]["tools_kwargs"] = {"web_search": {"create_kwargs": {"q": "x"}}}
    unknown = write_parquet(tmp_path / "unknown_tool.parquet", rows)
    with pytest.raises(DataError) as err:
        verl_eval.evaluate_verl(str(unknown), reward_fn=str(data["reward"]), **run)
    assert (err.value.row, err.value.column) == (1, "extra_info.tools_kwargs.web_search")
    assert "calc_gsm8k_reward" in str(err.value)
    broken = tmp_path / "broken_reward.py"
    broken.write_text("import no_such_module_here\n\ndef compute_score(**kw):\n    return 0.0\n")
    with pytest.raises(ConfigError) as err:
        verl_eval.evaluate_verl(str(data["arith"]), reward_fn=str(broken), **run)
    assert err.value.key == "--reward-fn" and "no_such_module_here" in str(err.value)
    yaml = tmp_path / "ppo.yaml"
    yaml.write_text(f"custom_reward_function:\n  path: {broken}\n  name: compute_score\n")
    with pytest.raises(ConfigError) as err:
        verl_eval.evaluate_verl(str(data["arith"]), verl_config_path=str(yaml), **run)
    assert err.value.key == "custom_reward_function.path"
    with pytest.raises(ConfigError) as err:
        verl_eval.evaluate_verl(str(data["arith"]), reward_fn=str(data["reward"]), reward_name="nope", **run)
    assert err.value.key == "--reward-name"
    with pytest.raises(DataError) as err:  # truncation=error (veRL's default) and a prompt over the length
        verl_eval.evaluate_verl(str(data["gsm8k"]), engine=engine, out=str(out),
                                overrides=["data.max_response_length=8", "data.max_prompt_length=40"])
    assert (err.value.row, err.value.column) == (0, "prompt") and "over data.max_prompt_length=40" in str(err.value)
    with pytest.raises(DataError, match="message 0 has role"):
        verl_eval.evaluate_verl(str(write_parquet(tmp_path / "role.parquet", [{**arith_rows()[0], "prompt": [
            {"role": "robot", "content": "hi"}]}])), reward_fn=str(data["reward"]), **run)
    assert not out.exists()


def test_resume_skips_written_rows_and_gives_the_same_metrics(data, tmp_path, engine):
    common = dict(engine=engine, reward_fn=str(data["reward"]), overrides=["data.max_response_length=8"])
    files = [str(data["gsm8k"]), str(data["arith"])]
    full = verl_eval.evaluate_verl(files, out=str(tmp_path / "full.jsonl"), **common)
    part = tmp_path / "part.jsonl"
    first = verl_eval.evaluate_verl(files, out=str(part), limit=2, **common)
    assert first.summary["samples"] == 2
    with part.open("a") as fh:
        fh.write('{"row": 2, "sample": 0, "data_so')  # the interrupted run's torn last line
    again = verl_eval.evaluate_verl(files, out=str(part), batch_size=2, **common)
    assert again.summary["resumed_rows"] == 2 and again.summary["samples"] == 5
    assert len(part.read_text().splitlines()) == 5
    assert again.metrics == full.metrics
    assert [r["response"] for r in again.records] == [r["response"] for r in full.records]
    with pytest.raises(ConfigError) as err:  # another data file's samples
        verl_eval.evaluate_verl(str(data["arith"]), out=str(part), **common)
    assert err.value.key == "--out"


def test_gsm8k_preset_and_the_verl_path_agree_on_the_same_problems(data, tmp_path, engine):
    """`final eval gsm8k` is the veRL path with GSM8K's rows: on the parquet of the same problems, with the tools
    described in the system message as the preset does, the conversations, scores and summary figures match."""
    from final.evals import gsm8k
    from final.evals.runner import EngineGenerator
    from final.tools.gsm8k_task import load_problems

    problems = load_problems(GSM8K, limit=3)
    schemas = engine.tool_schemas()
    summary = gsm8k.evaluate(EngineGenerator(engine, {"temperature": 0.0}), problems, schemas, False, 64,
                             tmp_path / "gsm8k.jsonl", engine.tokenizer)
    result = verl_eval.evaluate_verl(str(data["gsm8k"]), engine=engine, tools_in_system=True,
                                     out=str(tmp_path / "verl.jsonl"), overrides=["data.max_response_length=8"])
    preset = [json.loads(line) for line in (tmp_path / "gsm8k.jsonl").read_text().splitlines()]
    assert [r["messages"] for r in preset] == [r["messages"] for r in result.records]
    assert [r["score"] for r in preset] == [r["score"] for r in result.records]
    core = "acc" if REWARD_NUMBER_AS_ACC else "reward"  # veRL 0.9 reports a number-valued score as acc too
    assert summary["accuracy"] == result.metrics[f"val-core/openai/gsm8k/{core}/mean@1"]
    assert summary["tool_call_rate"] == result.summary["tool_call_rate"]
    assert summary["metrics"] == result.metrics
