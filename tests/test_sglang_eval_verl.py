"""`final eval verl` on the real SGLang 0.5.2 (CPU, tests/sglang_cpu) through veRL's own SGLangRollout: a veRL
parquet with tools, two data sources and a custom reward function gives the embedded engine's samples and the same
val-core metrics (greedy; float32 on both)."""

from __future__ import annotations

from pathlib import Path

from sglang_helpers import CPU_ARGS, TINY, use_sglang_cpu
from test_eval_verl import REWARD, arith_rows, gsm8k_multiturn_w_tool, write_parquet

ROOT = Path(__file__).resolve().parents[1]


def config(model: str, name: str) -> dict:
    engine_kwargs = {"sglang": dict(CPU_ARGS)} if name == "sglang" else {}
    return {"model_path": model, "progress": False,
            "rollout": {"name": name, "dtype": "float32", "engine_kwargs": engine_kwargs}}


def test_eval_verl_on_sglang_gives_the_embedded_engines_samples_and_metrics(tmp_path):
    use_sglang_cpu()
    from final.evals.verl_eval import evaluate_verl
    from final.models import resolve_model_path
    from multiturn_helpers import make_tool_model

    # veRL's SGLangRollout picks its tool-call parser from the vocabulary: a model with <tool_call> tokens
    model = make_tool_model(resolve_model_path(TINY), tmp_path / "m")
    (tmp_path / "reward.py").write_text(REWARD)
    files = [str(gsm8k_multiturn_w_tool(tmp_path / "g.parquet", count=2)),
             str(write_parquet(tmp_path / "a.parquet", arith_rows()))]
    common = dict(tools=str(ROOT / "tools.yaml"), reward_fn=str(tmp_path / "reward.py"),
                  overrides=["data.max_response_length=8"])
    local = evaluate_verl(files, config=config(model, "local"), out=str(tmp_path / "local.jsonl"), **common)
    sglang = evaluate_verl(files, config=config(model, "sglang"), out=str(tmp_path / "sglang.jsonl"), **common)
    assert [r["response"] for r in sglang.records] == [r["response"] for r in local.records]
    assert [r["messages"] for r in sglang.records] == [r["messages"] for r in local.records]
    assert sglang.metrics == local.metrics
    assert {k for k in local.metrics if k.startswith("val-core")} == {
        "val-core/openai/gsm8k/reward/mean@1", "val-core/final/arith/reward/mean@1"}
