"""The tool mode of examples/grpo.py (`--tools`): a policy learns to use a calculator through final's multi-turn loop.

    .venv/bin/python examples/grpo.py --tools --out /tmp/grpo/tools                      # calls as sampled
    .venv/bin/python examples/grpo.py --tools --constrain-calls --out /tmp/grpo/strict   # calls held to the schema

The problems are arithmetic a 135M model gets wrong in its head (two-digit products, three-digit sums and
differences), each asking to use the calculator and to give the answer on a last line "#### <number>". The engine
offers one tool, `final.tools.calculator.CalculatorTool` (a tools.yaml written into --out), and runs veRL's
multi-turn loop (`rollout.multi_turn`: up to --max-turns assistant turns; --max-tokens is the whole conversation's
response budget, tool results included, as veRL's response_length is). With --constrain-calls,
`rollout.multi_turn.constrain_tool_calls` holds every call the policy starts to the calculator's schema while text
stays free.

A row's trajectory is its prompt ids and response ids (assistant turns, tool results, template glue) with
response_mask 1 on the tokens the policy wrote; only those carry loss. The multi-turn loop returns no per-token
logprobs (veRL's rollout_log_probs keep one per row), so the old policy is the policy before the step (veRL's
recomputed old_log_prob: with one optimizer step per rollout the ratio is 1, plain policy gradient, and there is
no engine-policy gap to check); each row's weights_version still proves it came from the last update.

Reward: veRL's GSM8K scorer on the final assistant message (1 or 0); a wrong answer whose conversation ran the
calculator (a call that ran and computed) scores --call-bonus instead (0.2; 0: correctness only): SmolLM2-135M-Instruct
almost never answers these right unaided, so without a format reward (as tool-RL recipes use) no group carries
signal. The held-out reward is correctness alone. Malformed calls: calls the parser could not read (the
loop tells the model so in a tool message and goes on), calls of a tool not offered, and calls whose arguments fail
the calculator's schema, as a share of the calls the policy started.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable

import jsonschema

from final.chat_template import detect_family, fallback_messages
from final.tools.calculator import CALCULATOR_SCHEMA
from final.tools.parser import ToolCallParser

INSTRUCTION = (" First call the calculator tool with the arithmetic expression, then write the final answer on the "
               'last line as "#### <number>".')
NAME = CALCULATOR_SCHEMA["function"]["name"]
TOOLS_YAML = {"tools": [{"class_name": "final.tools.calculator.CalculatorTool", "config": {"type": "native"},
                         "tool_schema": CALCULATOR_SCHEMA}]}
NAMES = ["Tom", "Ana", "Ben", "Mia", "Sam", "Lily", "Raj", "Zoe", "Omar", "Nina", "Leo", "Ivy"]
ITEMS = ["apples", "books", "marbles", "pencils", "stickers", "cookies", "shells", "coins", "cards", "stamps"]


def make_problem(rng: random.Random) -> tuple[str, str]:
    """(question, answer): a product of two two-digit numbers, or a sum or difference of three-digit ones."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(12, 99), rng.randint(12, 99)
        return f"A box holds {a} {item}. How many {item} are in {b} boxes?", str(a * b)
    if kind == 1:
        a, b = rng.randint(120, 999), rng.randint(120, 999)
        return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", str(a + b)
    a = rng.randint(400, 999)
    b = rng.randint(101, a - 50)
    return f"{name} had {a} {item} and gave {b} of them away. How many {item} does {name} have left?", str(a - b)


def messages(tokenizer: Any, question: str) -> list[dict]:
    """The question, with the calculator in the system message where the model's template renders no tools
    (SmolLM2's ChatML: final's documented fallback, the block a per-call tools= prompt gets; veRL's multi-turn path
    renders tools.yaml's tools only through the template)."""
    chat = [{"role": "user", "content": question + INSTRUCTION}]
    return fallback_messages(tokenizer, chat, [CALCULATOR_SCHEMA], detect_family(tokenizer))[0]


def engine_config(model_dir: str, args: Any, folder: Path) -> dict:
    """InferenceEngine's config: the local backend with the calculator in a multi-turn loop."""
    tools = folder / "tools.yaml"
    tools.write_text(json.dumps(TOOLS_YAML, indent=1))  # YAML is a superset of JSON
    # tokenization_sanity_check_mode: veRL's per-turn check warns on every turn of a ChatML model (its template ends
    # an assistant turn with "<|im_end|>\n", generation stops at "<|im_end|>"); the tokens are veRL's either way
    multi_turn = {"enable": True, "tool_config_path": str(tools), "max_assistant_turns": args.max_turns,
                  "tokenization_sanity_check_mode": "disable"}
    if args.constrain_calls:
        multi_turn["constrain_tool_calls"] = True
    return {"model_path": model_dir, "progress": False, "rollout": {
        "name": "local", "dtype": args.engine_dtype, "prompt_length": 512, "response_length": args.max_tokens,
        "multi_turn": multi_turn, "engine_kwargs": {"local": {"device": args.device}}}}


def call_counts(row: dict, parser: ToolCallParser) -> tuple[int, int]:
    """(malformed calls, calls) the policy wrote in a multi-turn row: the calls the loop read (its trace: an error
    means unreadable or no such tool; a read call's arguments must fit the calculator's schema), and those of a last
    turn the loop never ran, read from its text as the loop's parser reads it."""
    traced = _traced(row)
    calls = [(c.get("error"), c.get("name"), c.get("arguments")) for c in traced]
    last = max((i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"), default=None)
    if last is not None and last not in {c.get("message_index") for c in traced}:
        content = row["messages"][last].get("content")
        found = parser.parse(content).calls if isinstance(content, str) else []
        calls += [(c.error, c.name, c.arguments) for c in found]
    bad = 0
    for error, name, arguments in calls:
        if error or name != NAME:
            bad += 1
            continue
        try:
            jsonschema.validate(arguments, CALCULATOR_SCHEMA["function"]["parameters"])
        except jsonschema.ValidationError:
            bad += 1
    return bad, len(calls)


def calculated(row: dict) -> bool:
    """Whether the calculator computed something in this row (a call that ran and did not answer "error: ...")."""
    return any(not c.get("error") and not str(c.get("response", "")).startswith("error:") for c in _traced(row))


def _traced(row: dict) -> list[dict]:
    """The loop's trace of the calls it read in a row: its per-call entries (they carry a turn), not finish errors."""
    return [c for c in row.get("tool_calls") or [] if "turn" in c]


def rollout(engine: Any, questions: list[str], answers: list[str], reward: Callable[[str, str], float], args: Any,
            seed: int, n: int, temperature: float) -> tuple[list[dict], int]:
    """Each question's n conversations; per row its prompt and response ids, the policy-token mask, reward, call
    counts and cached prompt tokens; and the policy version every row reports (checked to be the engine's)."""
    sampling = {"temperature": temperature, "top_p": 1.0, "top_k": -1} if temperature > 0 else {"temperature": 0}
    out = engine.generate([messages(engine.tokenizer, q) for q in questions], n=n, seed=seed, **sampling)
    versions = {m["weights_version"] for m in out.metadata}
    if versions != {engine.weights_version}:
        raise RuntimeError(f"rows report policy versions {versions}, the engine serves {engine.weights_version}")
    parser, rows = ToolCallParser.for_tokenizer("auto", engine.tokenizer), []
    for i, (text, meta) in enumerate(zip(out.completions, out.metadata)):
        bad, calls = call_counts(meta, parser)
        correct = reward(text, answers[i // n])
        bonus = args.call_bonus if calculated(meta) else 0.0
        rows.append({"prompt": meta["prompt_ids"], "response": meta["response_ids"], "mask": meta["response_mask"],
                     "correct": correct, "reward": max(correct, bonus), "malformed": bad, "calls": calls,
                     "cached": meta["cached_tokens"], "turns": meta["num_turns"]})
    return rows, versions.pop()
