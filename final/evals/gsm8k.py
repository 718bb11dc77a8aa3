"""`final eval gsm8k`: GSM8K accuracy with veRL's scorer, with or without the calc_gsm8k_reward tool - a preset of
`final eval verl`'s path (final/evals/runner.py): the problems become veRL rows (data source openai/gsm8k, the ground
truth, the tool's tools_kwargs), scored and recorded as every veRL dataset is, plus GSM8K's own fields.

Problems and prompts are final/tools/gsm8k_task.py's (veRL's own preprocessing); with tools, per-problem
tools_kwargs carry the ground truth to the tool's `create`. `--cartridge FILE` (repeatable) serves every problem
behind the cartridge(s), e.g. a tool-use cartridge from `final cartridge traces` + `train`.

Scoring is veRL's: `default_compute_score("openai/gsm8k", response, ground_truth)` (strict "#### <number>") on the
decoded response exactly as NaiveRewardManager decodes it (all response tokens, tool results included, special
tokens skipped). Also reported: flexible-match accuracy, tool-call rate, mean assistant turns, the tool's own reward,
model tokens per second (tokens the model wrote / wall time of generation), and veRL's validation metrics.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from final.cli import add_replica_args, load_cartridges, open_engine
from final.config import PACKAGE_TOOLS
from final.errors import ConfigError
from final.evals.runner import (CallableGenerator, EngineGenerator, Generator, add_constraint_flag, constraint_of,
                                run_rows)
from final.evals.verl_data import Row
from final.evals.verl_reward import format_metrics, load_scorer, validation_metrics
from final.tools.gsm8k_task import (DATA_SOURCE, TOOL_NAME, Problem, build_messages, load_problems,  # noqa: F401
                                    template_renders_tools)
if TYPE_CHECKING:  # the CLI imports this module; veRL and torch load only when an eval runs
    from final.outputs import GenerationOutput

# generate(messages per problem, tools_kwargs per problem or None) -> one row per problem
# (InferenceEngine.generate, or a pool of replicas with the same API)
Generate = Callable[[list[list[dict]], "list[dict] | None"], "GenerationOutput"]


def problem_rows(problems: list[Problem], tool_schemas: Sequence[dict] | None, renders_tools: bool,
                 path: str = "gsm8k") -> list[Row]:
    """The problems as veRL rows (gsm8k_multiturn_w_tool.py's fields, final's messages)."""
    return [Row(p.index, path, p.index, DATA_SOURCE, build_messages(p, tool_schemas, renders_tools), p.ground_truth,
                {"index": p.index, "question": p.question, "answer": p.answer},
                {TOOL_NAME: {"create_kwargs": {"ground_truth": p.ground_truth}}} if tool_schemas else {},
                ability="math", fields={"question": p.question}) for p in problems]


def gsm8k_fields(record: dict, row: Row, meta: dict) -> None:
    """GSM8K's own fields of a record: the strict extraction, the flexible score, the tool's reward."""
    from verl.utils.reward_score.gsm8k import compute_score, extract_solution

    record["extracted"] = extract_solution(record["response"], method="strict")
    record["flexible_score"] = float(compute_score(record["response"], row.ground_truth, method="flexible"))
    record["tool_reward"] = (meta.get("rewards") or {}).get(TOOL_NAME)


def evaluate(generate: Generate | Generator, problems: list[Problem], tool_schemas: Sequence[dict] | None,
             renders_tools: bool, batch_size: int = 64, out_path: str | Path | None = None,
             tokenizer: Any = None) -> dict:
    """Run the problems in batches, score them, write one JSON line per problem, return the summary (with veRL's
    validation metrics under "metrics")."""
    generator = CallableGenerator(generate) if callable(generate) else generate
    run = run_rows(problem_rows(problems, tool_schemas, renders_tools), generator, load_scorer(None), tokenizer,
                   multi_turn=bool(tool_schemas), batch_size=batch_size, out_path=out_path, extend=gsm8k_fields)
    return {**summarize(run.records, run.seconds, tools=bool(tool_schemas)),
            "metrics": validation_metrics(run.records)}


def summarize(records: list[dict], seconds: float, tools: bool) -> dict:
    n = len(records)
    tokens = sum(r["completion_tokens"] for r in records)
    rewards = [r["tool_reward"] for r in records if r["tool_reward"] is not None]
    return {
        "problems": n, "tools": tools,
        "accuracy": sum(r["score"] for r in records) / n,
        "flexible_accuracy": sum(r["flexible_score"] for r in records) / n,
        "tool_call_rate": sum(1 for r in records if r["tool_calls"]) / n,
        # a call the parser read and the tool ran (a malformed call is in tool_calls with its error)
        "well_formed_call_rate": sum(1 for r in records if any(not c.get("error") for c in r["tool_calls"])) / n,
        "mean_tool_calls": sum(len(r["tool_calls"]) for r in records) / n,
        "mean_turns": sum(r["num_turns"] for r in records) / n,
        "mean_tool_reward": sum(rewards) / len(rewards) if rewards else None,
        "completion_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0,
    }


def format_table(summary: dict) -> str:
    rows = [("problems", f"{summary['problems']}"), ("tools", "yes" if summary["tools"] else "no"),
            ("accuracy (veRL gsm8k, strict)", f"{summary['accuracy']:.3f}"),
            ("accuracy (flexible)", f"{summary['flexible_accuracy']:.3f}"),
            ("tool-call rate", f"{summary['tool_call_rate']:.3f}"),
            ("well-formed call rate", f"{summary['well_formed_call_rate']:.3f}"),
            ("mean tool calls", f"{summary['mean_tool_calls']:.2f}"),
            ("mean assistant turns", f"{summary['mean_turns']:.2f}"),
            ("mean tool reward", "-" if summary["mean_tool_reward"] is None else f"{summary['mean_tool_reward']:.3f}"),
            ("model tokens", f"{summary['completion_tokens']}"),
            ("generation time (s)", f"{summary['seconds']:.1f}"),
            ("tokens/s", f"{summary['tokens_per_s']:.1f}")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ---- command line: `final eval gsm8k ...` (final/evals/cli.py registers it) ---------------------------------------
def register(subparsers: Any) -> None:
    """Add `gsm8k` to the subparsers of `final eval`."""
    p = subparsers.add_parser("gsm8k", help="GSM8K accuracy (veRL's scorer), with or without calc_gsm8k_reward")
    p.add_argument("--config", default=None, help="config file (default: $FINAL_CONFIG, ./config.yaml, or the "
                                                 "package's): any backend")
    p.add_argument("--data", required=True, help="GSM8K JSONL with question/answer per line")
    p.add_argument("--limit", type=int, default=None, help="first N problems")
    p.add_argument("--tools", nargs="?", const="", default=None, metavar="TOOLS_YAML",
                   help="enable tool calling with this tools.yaml (default: ./tools.yaml, else the package's)")
    p.add_argument("--model", default=None, help="override model_path")
    p.add_argument("--cartridge", action="append",
                   help="serve every problem behind this cartridge id or .pt/.safetensors file (repeat to compose)")
    add_replica_args(p)
    p.add_argument("--prompt-length", type=int, default=None, help="override rollout.prompt_length")
    p.add_argument("--response-length", type=int, default=None, help="override rollout.response_length")
    p.add_argument("--max-assistant-turns", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="the chat template's variables, e.g. '{\"enable_thinking\": false}' for Qwen3")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--out", default=None, help="per-problem JSONL (default: gsm8k[_tools]_results.jsonl)")
    add_constraint_flag(p)
    p.set_defaults(func=run_cli)


def overrides_from_args(args: Any) -> dict:
    """The command's flags as config overrides (deep-merged over the config file)."""
    rollout: dict[str, Any] = {"calculate_log_probs": False}  # scoring reads text: no logprob pass per conversation
    if args.prompt_length is not None:
        rollout["prompt_length"] = args.prompt_length
    if args.response_length is not None:
        rollout["response_length"] = args.response_length
    if args.tools is not None:
        path = args.tools or ("tools.yaml" if Path("tools.yaml").exists() else str(PACKAGE_TOOLS))
        rollout["multi_turn"] = {"enable": True, "tool_config_path": path,
                                 # the tokenization sanity check only logs template diffs: skip its extra work
                                 "tokenization_sanity_check_mode": "disable"}
        if args.max_assistant_turns is not None:
            rollout["multi_turn"]["max_assistant_turns"] = args.max_assistant_turns
    out: dict[str, Any] = {"progress": False, "rollout": rollout}
    if args.model:
        out["model_path"] = args.model
    return out


def template_kwargs(args: Any) -> dict:
    """--chat-template-kwargs as generate()'s chat_template_kwargs (a JSON object; checked by prepare)."""
    if args.chat_template_kwargs is None:
        return {}
    try:
        return {"chat_template_kwargs": json.loads(args.chat_template_kwargs)}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"must be a JSON object: {exc}", key="--chat-template-kwargs") from None


def run_cli(args: Any) -> int:
    if args.batch_size < 1:
        raise ConfigError(f"must be >= 1, got {args.batch_size}", key="--batch-size")
    problems = load_problems(args.data, args.limit)
    constraint = constraint_of(args.constraint)
    with open_engine(args, **overrides_from_args(args)) as engine:
        schemas = engine.tool_schemas() if args.tools is not None else None
        if schemas is not None and TOOL_NAME not in [s["function"]["name"] for s in schemas]:
            raise ConfigError(f"the GSM8K eval needs the {TOOL_NAME} tool in the tools file", key="--tools")
        renders = bool(schemas) and template_renders_tools(engine.tokenizer, schemas)
        out = args.out or ("gsm8k_tools_results.jsonl" if schemas else "gsm8k_results.jsonl")
        cartridge = load_cartridges(engine, args.cartridge)
        generator = EngineGenerator(engine, {"temperature": args.temperature, **constraint, **template_kwargs(args)},
                                    cartridge)
        summary = evaluate(generator, problems, schemas, renders, args.batch_size, out, engine.tokenizer)
    print(f"backend: {engine.backend} ({engine.config.source or 'config dict'}), model: {engine.config.model_path}"
          + (f", cartridge: {' + '.join(cartridge)}" if cartridge else ""))
    print(format_table(summary))
    print(format_metrics(summary["metrics"]))
    print(f"per-problem results: {out}")
    return 0
