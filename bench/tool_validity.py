"""Issue 80's validity measure: how often a model's function calls (and JSON answers) are well formed, with and
without constrained decoding.

    .venv/bin/python bench/tool_validity.py --split tune            # while tuning anything
    .venv/bin/python bench/tool_validity.py --split test            # once, for bench/RESULTS.md

The set (bench/tool_calls/): 13 tools with typed, enum, pattern, array and nested-object arguments (tools.json) and
60 requests (prompts.jsonl), each offering 4 of the tools (the expected one and 3 others) and naming the function it
needs; half tune, half test. Each request runs through InferenceEngine.generate(messages, tools=...) at greedy:
  auto      tool_choice "auto", unconstrained: the model may call or answer in text
  required  tool_choice "required": constrained to calls of the offered tools, arguments held to their schemas
            (needs the grammar backend; reported as not served where this build has none)
and the JSON form of the same requests (the expected function's arguments as a JSON object):
  json      asked for in the prompt, unconstrained
  json+schema  response_format json_schema (the function's parameters), constrained
Reported per mode: valid (the response's calls parse, name offered tools and their arguments validate against the
tool's schema, jsonschema; for JSON: the answer parses and validates), right (the first call names the expected
function), ended (the model ended the response within --max-tokens) and valid/ended (valid among those: a
constrained response that ran out of tokens is cut inside its call, not malformed). Figures do not depend on time;
the run prints the command that made them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from jsonschema import Draft202012Validator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from final.errors import FinalError  # noqa: E402
from final.inf import InferenceEngine  # noqa: E402

DATA = ROOT / "bench" / "tool_calls"


def load(split: str) -> tuple[dict[str, dict], list[dict]]:
    tools = {t["function"]["name"]: t for t in json.loads((DATA / "tools.json").read_text())}
    rows = [json.loads(line) for line in (DATA / "prompts.jsonl").read_text().splitlines() if line.strip()]
    return tools, [r for r in rows if split == "all" or r["split"] == split]


def valid_args(tool: dict, arguments: str) -> bool:
    try:
        args = json.loads(arguments)
    except ValueError:
        return False
    return isinstance(args, dict) and Draft202012Validator(tool["function"]["parameters"]).is_valid(args)


def judge_calls(row: dict, tools: dict, meta: dict) -> tuple[bool, bool, bool]:
    calls = (meta.get("message") or {}).get("tool_calls") or []
    ok = bool(calls) and not meta.get("tool_call_errors") and all(
        c["function"]["name"] in row["tools"] and valid_args(tools[c["function"]["name"]], c["function"]["arguments"])
        for c in calls)
    return ok, bool(calls) and calls[0]["function"]["name"] == row["expected"], meta["finish_reason"] != "length"


def judge_json(row: dict, tools: dict, text: str, meta: dict) -> tuple[bool, bool, bool]:
    ok = valid_args(tools[row["expected"]], text.strip())
    return ok, ok, meta["finish_reason"] != "length"


async def run_mode(engine: InferenceEngine, tools: dict, rows: list[dict], mode: str, max_tokens: int) -> dict:
    async def one(row: dict) -> tuple[bool, bool, bool]:
        offered = [tools[n] for n in row["tools"]]
        messages = [{"role": "user", "content": row["prompt"]}]
        if mode in ("auto", "required"):
            out = await engine.agenerate(messages, tools=offered, tool_choice=mode, temperature=0,
                                         max_tokens=max_tokens)
            return judge_calls(row, tools, out.metadata[0])
        schema = tools[row["expected"]]["function"]["parameters"]
        ask = [{"role": "user", "content": f"{row['prompt']}\nReply with only the arguments for the function "
                                           f"{row['expected']} as a JSON object matching this schema: "
                                           f"{json.dumps(schema)}"}]
        kw = {"response_format": {"type": "json_schema", "json_schema": {"name": "arguments", "schema": schema}}} \
            if mode == "json+schema" else {}
        out = await engine.agenerate(ask, temperature=0, max_tokens=max_tokens, **kw)
        return judge_json(row, tools, out.completions[0], out.metadata[0])

    try:
        results = await asyncio.gather(*(one(r) for r in rows))
    except FinalError as exc:  # a mode this build cannot serve (constrained decoding): say so, not a zero
        return {"mode": mode, "n": len(rows), "error": str(exc)}
    ended = [v for v, _, e in results if e]
    return {"mode": mode, "n": len(rows), "valid": sum(v for v, _, _ in results) / len(rows),
            "right": sum(r for _, r, _ in results) / len(rows), "ended": len(ended) / len(rows),
            "valid_of_ended": sum(ended) / len(ended) if ended else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--split", choices=["tune", "test", "all"], default="tune")
    p.add_argument("--model", default="builtin:smollm2-135m-instruct")
    p.add_argument("--modes", nargs="+", default=["auto", "required", "json", "json+schema"],
                   choices=["auto", "required", "json", "json+schema"])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out", default=None, help="write the figures as JSON here too")
    args = p.parse_args()
    tools, rows = load(args.split)
    config = {"model_path": args.model, "progress": False,
              "rollout": {"name": "local", "prompt_length": 2048, "response_length": args.max_tokens}}
    with InferenceEngine(config) as engine:
        figures = [asyncio.run(run_mode(engine, tools, rows, m, args.max_tokens)) for m in args.modes]
    print(f"# {' '.join(sys.argv)}  (model {args.model}, split {args.split}, {len(rows)} requests, greedy)")
    print(f"{'mode':<12} {'n':>3} {'valid':>7} {'right fn':>9} {'ended':>7} {'valid/ended':>12}")
    for f in figures:
        if "error" in f:
            print(f"{f['mode']:<12} {f['n']:>3}   not served: {f['error'][:90]}")
        else:
            of_ended = "-" if f["valid_of_ended"] is None else f"{f['valid_of_ended']:.0%}"
            print(f"{f['mode']:<12} {f['n']:>3} {f['valid']:>6.0%} {f['right']:>9.0%} {f['ended']:>7.0%} "
                  f"{of_ended:>12}")
    if args.out:
        Path(args.out).write_text(json.dumps({"split": args.split, "model": args.model, "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
