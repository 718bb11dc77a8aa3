"""`final eval verl`: validate on a veRL dataset as veRL's trainer does (`trainer.val_only=True`), on any backend.

    final eval verl --data val.parquet --tools tools.yaml --reward-fn my_reward.py
    final eval verl --verl-config ppo.yaml data.max_response_length=256 actor_rollout_ref.rollout.val_kwargs.n=4

    from final.evals.verl_eval import evaluate_verl
    result = evaluate_verl("val.parquet", tools="tools.yaml")   # result.metrics: veRL's val-core/... dict

The data, prompts, tools, reward and metrics are veRL's (final/evals/verl_config.py, verl_data.py, verl_reward.py);
the generation is InferenceEngine's (or a ReplicaPool's with --replicas): sampling from `rollout.val_kwargs`, the
response length from `rollout.response_length`, tool calling through veRL's multi-turn path when
`rollout.multi_turn` (or --tools) names a tool config. Outputs: the metrics (printed, and JSON with a summary
beside them), one JSON line per sample (final/evals/runner.py), resumable.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from final.errors import ConfigError, DataError
from final.evals import verl_config
from final.evals.runner import EngineGenerator, Run, add_constraint_flag, constraint_of, run_rows
from final.evals.verl_data import Row, check_tools, load_rows, render
from final.evals.verl_reward import check_sources, format_metrics, load_scorer, validation_metrics

DEFAULT_OUT = "verl_eval.jsonl"


@dataclass
class VerlEval:
    """What `evaluate_verl` returns: veRL's validation metrics, a summary and one record per sample."""

    metrics: dict[str, float]  # veRL's names: val-core/{data_source}/{var}/mean@N, ...
    summary: dict  # rows, samples, tool-call rate, turns, tokens, time; notes (rows veRL would warn about)
    records: list[dict]  # one per sample, by (row, sample)
    out: str | None
    metrics_path: str | None


def load_settings(data: str | Sequence[str] | None = None, verl_config_path: str | None = None,
                  overrides: Sequence[str] = (), tools: str | None = None, reward_fn: str | None = None,
                  reward_name: str | None = None) -> verl_config.VerlSettings:
    """The veRL settings, with the command's --data / --tools / --reward-fn on top of the composed config."""
    data = [data] if isinstance(data, str) else data
    settings = verl_config.settings(verl_config.compose(verl_config_path, list(overrides)), data)
    if tools is not None:
        settings.multi_turn = {**settings.multi_turn, "enable": True, "tool_config_path": tools or default_tools()}
    if reward_fn:
        name = reward_name or (settings.custom_reward or {}).get("name") or "compute_score"
        settings.custom_reward = {"path": reward_fn, "name": name, "reward_kwargs": settings.reward_kwargs,
                                  "path_key": "--reward-fn", "name_key": "--reward-name"}
    elif reward_name:
        raise ConfigError("needs --reward-fn (or custom_reward_function.path)", key="--reward-name")
    return settings


def default_tools() -> str:
    """./tools.yaml where it exists, else the tools.yaml shipped in the package."""
    from final.config import PACKAGE_TOOLS

    return "tools.yaml" if Path("tools.yaml").exists() else str(PACKAGE_TOOLS)


def engine_overrides(settings: verl_config.VerlSettings, model: str | None = None) -> dict:
    """final config overrides that make the engine the trainer's rollout: lengths and multi-turn settings."""
    if settings.tools_enabled:  # the sanity check only logs template differences: skip its extra work
        multi_turn = {**settings.multi_turn, "tokenization_sanity_check_mode": "disable"}
    else:
        multi_turn = {"enable": False}
    out: dict[str, Any] = {"progress": False, "rollout": {
        "prompt_length": settings.max_prompt_length, "response_length": settings.response_length,
        "calculate_log_probs": False, "multi_turn": multi_turn}}
    if model:
        out["model_path"] = model
    return out


def sampling_of(settings: verl_config.VerlSettings, seed: int | None = None) -> dict:
    """generate()'s keywords for rollout.val_kwargs (SGLangRollout: greedy unless do_sample, else val_kwargs'
    temperature/top_p/top_k), n samples a row and the response length."""
    val = settings.val_kwargs
    sampling: dict[str, Any] = {"n": int(val.get("n") or 1), "max_tokens": settings.response_length,
                                "do_sample": bool(val.get("do_sample", False))}
    if sampling["do_sample"]:
        sampling.update({k: val[k] for k in ("temperature", "top_p", "top_k") if val.get(k) is not None})
    if seed is not None:
        sampling["seed"] = seed
    return sampling


def evaluate_verl(data: str | Sequence[str] | None = None, *, verl_config_path: str | None = None,
                  overrides: Sequence[str] = (), engine: Any = None, config: Any = None, model: str | None = None,
                  tools: str | None = None, tools_in_system: bool = False, reward_fn: str | None = None,
                  reward_name: str | None = None, cartridge: Any = None, limit: int | None = None,
                  out: str | None = DEFAULT_OUT, metrics_out: str | None = None, batch_size: int = 64,
                  seed: int | None = None, resume: bool = True, progress: bool = False, replicas: int | None = None,
                  ray_address: str | None = None, constraint: dict[str, Any] | None = None) -> VerlEval:
    """Evaluate a veRL dataset (module doc). `engine`: an open InferenceEngine or ReplicaPool to use (its own
    config then decides lengths and tools); else one is opened from `config` (+ model, replicas) and closed.
    tools: a tool config ("" = ./tools.yaml, else the package's). tools_in_system: where the chat template ignores
    `tools` (SmolLM2's), write each row's tool schemas into its system message as `final eval gsm8k` does (veRL
    does not). constraint: a constraint key and its value for every answer ({"json_schema": ...}). Every check runs
    before any generation; a bad input raises DataError or ConfigError."""
    settings = load_settings(data, verl_config_path, overrides, tools, reward_fn, reward_name)
    rows = load_rows(settings.val_files, settings.prompt_key, settings.reward_fn_key, limit,
                     settings.need_tools_kwargs)
    scorer = load_scorer(settings.custom_reward)
    check_sources(scorer, rows, settings.reward_fn_key)
    owned = engine is None
    if owned:
        from final.pool import open_engine

        engine = open_engine(config, replicas=replicas, ray_address=ray_address, **engine_overrides(settings, model))
    try:
        return _evaluate(engine, settings, rows, scorer, tools_in_system=tools_in_system, cartridge=cartridge,
                         out=out, metrics_out=metrics_out, batch_size=batch_size, seed=seed, resume=resume,
                         progress=progress, constraint=constraint or {})
    finally:
        if owned:
            engine.shutdown()


def _evaluate(engine: Any, settings: verl_config.VerlSettings, rows: list[Row], scorer: Any, *,
              tools_in_system: bool, cartridge: Any, out: str | None, metrics_out: str | None, batch_size: int,
              seed: int | None, resume: bool, progress: bool, constraint: dict[str, Any]) -> VerlEval:
    from final.cli import load_cartridges

    multi_turn = bool(engine.rollout_config.multi_turn.enable)
    if settings.tools_enabled and not multi_turn:
        raise ConfigError("the engine has no tool calling on (rollout.multi_turn.enable) for this tool config",
                          key=f"{verl_config.ROLLOUT}.multi_turn.enable")
    tool_config = settings.multi_turn.get("tool_config_path") or "of the engine's config"
    untooled = check_tools(rows, engine.tool_names() if multi_turn else None, tool_config)
    if tools_in_system and multi_turn:
        describe_tools(rows, engine.tokenizer, engine.tool_schemas())
    kept, dropped = render(rows, engine.tokenizer, settings.max_prompt_length, settings.truncation,
                           settings.filter_overlong_prompts, settings.apply_chat_template_kwargs, settings.prompt_key)
    if not kept:
        raise DataError(f"every row is over data.max_prompt_length={settings.max_prompt_length} "
                        "(data.filter_overlong_prompts dropped them all)", path=rows[0].path)
    carts = load_cartridges(engine, [cartridge] if isinstance(cartridge, str) else cartridge)
    if carts:  # a prompt after a cartridge continues its stream (no BOS, no default system turn): final renders it
        for r in kept:
            r.prompt_ids = None
    sampling = {**sampling_of(settings, seed), **constraint}
    run = run_rows(kept, EngineGenerator(engine, sampling, carts, progress), scorer, engine.tokenizer,
                   multi_turn=multi_turn, batch_size=batch_size, out_path=out, resume=resume, progress=progress,
                   prompt_key=settings.prompt_key, n=sampling["n"])
    metrics = validation_metrics(run.records)
    summary = summarize(run, rows, dropped, untooled, sampling["n"])
    metrics_path = metrics_out or (str(Path(out).with_suffix(".metrics.json")) if out else None)
    if metrics_path:
        Path(metrics_path).write_text(json.dumps({"metrics": metrics, "summary": summary, "data": settings.val_files,
                                                  "val_kwargs": settings.val_kwargs}, indent=2, default=str) + "\n")
    return VerlEval(metrics, summary, run.records, out, metrics_path)


def describe_tools(rows: list[Row], tokenizer: Any, schemas: list[dict]) -> None:
    """--tools-in-system: each tool-offering row's system message gets its tools in the hermes format when the
    chat template ignores `tools` (the prompt `final eval gsm8k` and `final cartridge traces` build)."""
    from final.tools.gsm8k_task import HERMES_TOOLS, template_renders_tools

    by_name = {s["function"]["name"]: s for s in schemas}
    if not by_name or template_renders_tools(tokenizer, schemas):
        return
    for r in rows:
        if not r.tools_kwargs:
            continue
        text = HERMES_TOOLS.format(tools="\n".join(json.dumps(by_name[n], ensure_ascii=False) for n in r.tools_kwargs))
        if r.messages[0]["role"] == "system":
            r.messages[0] = {**r.messages[0], "content": r.messages[0]["content"] + text}
        else:
            r.messages.insert(0, {"role": "system", "content": text.lstrip()})


def summarize(run: Run, rows: list[Row], dropped: list[Row], untooled: list[Row], n: int) -> dict:
    """What the metrics leave out: counts, tool use, turns, tokens, speed; and the rows veRL would warn about."""
    records = run.records
    samples = max(len(records), 1)
    notes = []
    if dropped:
        notes.append(f"{len(dropped)} rows over data.max_prompt_length dropped (data.filter_overlong_prompts)")
    if untooled:
        notes.append(f"{len(untooled)} rows name tools in extra_info.tools_kwargs but no tool config is on "
                     "(--tools or actor_rollout_ref.rollout.multi_turn): they ran single-turn, as in veRL")
    missing = [r for r in rows if r.need_tools_kwargs and not r.tools_kwargs]
    if missing:
        notes.append(f"{len(missing)} rows have need_tools_kwargs but no tools_kwargs (veRL warns the same)")
    return {
        "rows": len(rows), "evaluated_rows": len(rows) - len(dropped), "filtered_rows": len(dropped), "n": n,
        "samples": len(records), "resumed_rows": run.resumed,
        "tool_call_rate": sum(1 for r in records if r["tool_calls"]) / samples,
        "mean_tool_calls": sum(len(r["tool_calls"]) for r in records) / samples,
        "mean_turns": sum(r["num_turns"] for r in records) / samples,
        "completion_tokens": sum(r["completion_tokens"] or 0 for r in records),
        "seconds": run.seconds, "tokens_per_s": run.tokens / run.seconds if run.seconds else 0.0, "notes": notes,
    }


def format_summary(summary: dict) -> str:
    """The summary as the table `final eval verl` prints."""
    rows = [("rows evaluated", f"{summary['evaluated_rows']} of {summary['rows']}"
             + (f" ({summary['resumed_rows']} resumed)" if summary["resumed_rows"] else "")),
            ("samples (n per row)", f"{summary['samples']} ({summary['n']})"),
            ("tool-call rate", f"{summary['tool_call_rate']:.3f}"),
            ("mean assistant turns", f"{summary['mean_turns']:.2f}"),
            ("model tokens", f"{summary['completion_tokens']}"),
            ("generation time (s)", f"{summary['seconds']:.1f}"), ("tokens/s", f"{summary['tokens_per_s']:.1f}")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ---- command line: `final eval verl ...` (final/evals/cli.py registers it) ----------------------------------------
def register(subparsers: Any) -> None:
    from final.cli import add_replica_args

    p = subparsers.add_parser("verl", help="veRL's validation metrics on a veRL dataset (parquet), any backend")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="Hydra overrides of veRL's trainer config (ppo_trainer.yaml): data.max_response_length=256")
    p.add_argument("--data", action="append", help="veRL-format parquet (repeatable; default: data.val_files)")
    p.add_argument("--verl-config", default=None, help="a veRL trainer YAML (composed over ppo_trainer.yaml)")
    p.add_argument("--config", default=None, help="final config (default: $FINAL_CONFIG, ./config.yaml, or the "
                                                 "package's): any backend")
    p.add_argument("--model", default=None, help="override model_path")
    p.add_argument("--cartridge", action="append", help="serve every row behind this cartridge id or file")
    p.add_argument("--tools", nargs="?", const="", default=None, metavar="TOOLS_YAML",
                   help="tool config (default: rollout.multi_turn.tool_config_path; bare: ./tools.yaml or the "
                        "package's)")
    p.add_argument("--tools-in-system", action="store_true",
                   help="describe each row's tools in its system message when the chat template ignores `tools`")
    p.add_argument("--reward-fn", default=None, metavar="FILE", help="custom reward function file "
                                                                     "(custom_reward_function.path)")
    p.add_argument("--reward-name", default=None, help="its function name (default: compute_score)")
    p.add_argument("--limit", type=int, default=None, help="first N rows")
    p.add_argument("--batch-size", type=int, default=64, help="rows per generate call")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (row i of a call: seed + i)")
    p.add_argument("--out", default=DEFAULT_OUT, help="per-sample JSONL (resumed if it exists)")
    p.add_argument("--metrics-out", default=None, help="metrics JSON (default: OUT with .metrics.json)")
    p.add_argument("--no-resume", action="store_true", help="start over instead of resuming --out")
    add_constraint_flag(p)
    add_replica_args(p)
    p.set_defaults(func=run_cli)


def run_cli(args: Any) -> int:
    result = evaluate_verl(
        args.data, verl_config_path=args.verl_config, overrides=args.overrides, config=args.config, model=args.model,
        tools=args.tools, tools_in_system=args.tools_in_system, reward_fn=args.reward_fn,
        reward_name=args.reward_name, cartridge=args.cartridge, limit=args.limit, out=args.out,
        metrics_out=args.metrics_out, batch_size=args.batch_size, seed=args.seed, resume=not args.no_resume,
        progress=True, replicas=args.replicas, ray_address=args.ray_address,
        constraint=constraint_of(args.constraint))
    for note in result.summary["notes"]:
        print(f"note: {note}", file=sys.stderr)
    print(format_metrics(result.metrics))
    print(format_summary(result.summary))
    print(f"per-sample results: {result.out}\nmetrics: {result.metrics_path}")
    return 0
