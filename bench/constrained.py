"""Constrained decoding on the embedded engine: what a JSON-schema constraint costs, and what it buys.

1. Decode tok/s with a JSON-schema constraint against unconstrained, side by side in one run (alternating calls,
   median of --repeats), at batch 1 and 8 (the prompt repeated; sampled at temperature 1 with a seed). Both sides
   generate exactly --tokens tokens: the schema (an array of at least 200 records) cannot complete sooner, and
   the unconstrained side runs with ignore_eos. Goal: constrained >= 0.85x.
2. Compile time: the engine's first constrained request (the llguidance tokenizer is built then, once), a new
   schema's compile, and the same schema again (the LRU's cached grammar, copied for the row).
3. Validity (does not depend on time): bench/data/constrained_json.json's prompts (7 schemas, tune/test halves),
   greedy, the schema in the prompt; % of outputs that parse as JSON and validate against their schema, without
   and with the json_schema constraint (a fenced ```json block counts as its content).

    PYTHONPATH=$PWD .venv/bin/python bench/constrained.py                       # SmolLM2 fp32, all three parts
    PYTHONPATH=$PWD .venv/bin/python bench/constrained.py --parts validity --split test
    PYTHONPATH=$PWD .venv/bin/python bench/constrained.py --tokens 16 --repeats 1 --parts speed,compile  # smoke
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import jsonschema
from transformers import AutoTokenizer

from final.engine import EmbeddedEngine
from final.models import resolve_model_path

DATA = Path(__file__).resolve().parent / "data" / "constrained_json.json"
RECORD = {"type": "object", "additionalProperties": False, "required": ["name", "score", "tags"], "properties": {
    "name": {"type": "string"}, "score": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}}
LONG = {"type": "object", "required": ["records"], "properties": {"records": {
    "type": "array", "minItems": 200, "items": RECORD}}}
FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S)


def decode_speed(engine: EmbeddedEngine, ids: list[int], tokens: int, repeats: int) -> list[dict]:
    rows = []
    for batch in (1, 8):
        base = {"max_new_tokens": tokens, "temperature": 1.0, "seed": 5}
        sides = {"unconstrained": {**base, "ignore_eos": True}, "json_schema": {**base, "json_schema": json.dumps(LONG)}}
        engine.generate([ids] * batch, sides["json_schema"])  # warm-up (and the grammar compiled once)
        took: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(repeats):
            for name, params in sides.items():
                start = time.perf_counter()
                outs = engine.generate([ids] * batch, params)
                took[name].append(time.perf_counter() - start)
                assert all(len(o["output_ids"]) == tokens for o in outs), f"{name}: a row ended early"
        rate = {name: batch * tokens / statistics.median(t) for name, t in took.items()}
        rows.append({"batch": batch, **{f"{k}_tok_s": round(v, 1) for k, v in rate.items()},
                     "ratio": round(rate["json_schema"] / rate["unconstrained"], 3)})
    return rows


def compile_times(engine: EmbeddedEngine) -> dict:
    grammars, stamp = engine.grammars, time.time_ns()
    start = time.perf_counter()
    grammars.tokenizer  # noqa: B018 - built on the engine's first constrained request
    setup = time.perf_counter() - start
    schema = json.dumps({**RECORD, "title": f"fresh-{stamp}"})  # a text no cache has seen
    start = time.perf_counter()
    grammars.row("json_schema", schema)
    first = time.perf_counter() - start
    start = time.perf_counter()
    grammars.row("json_schema", schema)
    cached = time.perf_counter() - start
    return {"tokenizer_setup_ms": round(setup * 1e3, 1), "first_compile_ms": round(first * 1e3, 2),
            "cached_ms": round(cached * 1e3, 3)}


def valid(text: str, schema: dict) -> bool:
    match = FENCE.search(text)
    try:
        jsonschema.validate(json.loads(match.group(1) if match else text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def validity(engine: EmbeddedEngine, tok, split: str, max_tokens: int) -> dict:
    data = json.loads(DATA.read_text())
    rows = [r for r in data["prompts"] if split == "all" or r["split"] == split]
    result = {}
    for constrained in (False, True):
        ok = 0
        for row in rows:
            schema = data["schemas"][row["schema"]]
            ask = f"{row['prompt']}\nAnswer with only a JSON object matching this JSON schema:\n{json.dumps(schema)}"
            ids = tok.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True)
            params = {"max_new_tokens": max_tokens, "temperature": 0}
            if constrained:
                params["json_schema"] = json.dumps(schema)
            out = engine.generate(ids, params)
            ok += valid(tok.decode(out["output_ids"], skip_special_tokens=True), schema)
        result["constrained" if constrained else "unconstrained"] = f"{ok}/{len(rows)} ({100 * ok / len(rows):.0f}%)"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--quantization", choices=["bf16", "int8"], default=None)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per row in the speed part")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--parts", default="speed,compile,validity")
    parser.add_argument("--split", choices=["tune", "test", "all"], default="tune")
    parser.add_argument("--max-tokens", type=int, default=256, help="per answer in the validity part")
    args = parser.parse_args()
    path = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    engine = EmbeddedEngine(path, max_model_len=1024, quantization=args.quantization)
    parts = set(args.parts.split(","))
    try:
        if "compile" in parts:
            print("compile:", json.dumps(compile_times(engine)))
        if "speed" in parts:
            ids = tok.apply_chat_template([{"role": "user", "content": "List records as JSON."}],
                                          add_generation_prompt=True)
            for row in decode_speed(engine, ids, args.tokens, args.repeats):
                print("decode:", json.dumps(row))
        if "validity" in parts:
            print(f"validity ({args.split}):", json.dumps(validity(engine, tok, args.split, args.max_tokens)))
    finally:
        engine.shutdown()
    print("reproduce: PYTHONPATH=$PWD .venv/bin/python bench/constrained.py "
          f"--model {args.model} --tokens {args.tokens} --repeats {args.repeats} --parts {args.parts} "
          f"--split {args.split} --max-tokens {args.max_tokens}"
          + (f" --quantization {args.quantization}" if args.quantization else ""))


if __name__ == "__main__":
    main()
