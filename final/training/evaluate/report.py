"""What `final cartridge eval` does: a cartridge's answers to a question set against no document, the document's
first p and 8p tokens and the whole document (accuracy.py), or two cartridges served together (composed.py);
a markdown table per set, or JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from final.cartridges.format import CartridgeKV
from final.cartridges.service import CartridgeService
from final.errors import CartridgeError
from final.inf import InferenceEngine
from final.training.evaluate.accuracy import qa_evaluate, table
from final.training.evaluate.composed import ComposeSet, compose_evaluate, compose_table
from final.training.evaluate.questions import load_qa
from final.training.inputs import open_engine


def run(args: argparse.Namespace) -> int:
    _check_flags(args)
    inference = open_engine(args.model, args.dtype)
    try:
        service = CartridgeService(inference.engine, inference.model_dir)
        cart = service.read_served(args.path, positions=args.positions)
        if args.compose is not None:
            report = {"compose": _compose(args, inference, service, cart)}
        else:
            report = {"qa": _qa(args, inference, cart)}
    finally:
        inference.shutdown()
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    """--compose and --compose-qa come together; each file exists (checked before the model loads)."""
    if args.chunk_tokens is not None and args.chunk_tokens < 1:
        raise CartridgeError(f"--chunk-tokens must be at least 1, got {args.chunk_tokens}", field="chunk_tokens")
    if (args.compose is None) != (args.compose_qa is None):
        given, missing = ("compose", "compose-qa") if args.compose is not None else ("compose-qa", "compose")
        raise CartridgeError(f"--{given} needs --{missing}", field=missing)
    for path, flag in ((args.compose, "compose"), (args.compose_qa, "compose-qa")):
        if path is not None and not path.exists():
            raise CartridgeError("file does not exist", file=str(path), field=flag)


def _split(args: argparse.Namespace) -> str | None:
    return None if args.split == "all" else args.split


def _qa(args: argparse.Namespace, inference: InferenceEngine, cart: CartridgeKV) -> dict:
    qa = load_qa(args.qa, _split(args), document=args.text)
    rows = qa_evaluate(inference, qa.document, qa.questions, cart, chunk_tokens=args.chunk_tokens)
    if not args.json:
        print(f"{qa.name}: {len(qa.questions)} questions ({args.split})")
        print(table(rows))
    return {"set": qa.name, "split": args.split, "questions": len(qa.questions),
            "rows": [dataclasses.asdict(r) for r in rows]}


def _compose(args: argparse.Namespace, inference: InferenceEngine, service: CartridgeService,
             cart: CartridgeKV) -> dict[str, Any]:
    qa_a, qa_b = load_qa(args.qa, _split(args), document=args.text), load_qa(args.compose_qa, _split(args))
    cart_b = service.read_served(args.compose, positions=args.positions)
    result = compose_evaluate(inference, ComposeSet(qa_a.name, qa_a.document, qa_a.questions, cart),
                              ComposeSet(qa_b.name, qa_b.document, qa_b.questions, cart_b))
    if not args.json:
        for qa in (qa_a, qa_b):
            print(f"{qa.name}: {len(qa.questions)} questions ({args.split})")
            print(compose_table(result, qa.name))
    return {"split": args.split, "separator": result.separator, "composed": result.composed, "keeps": result.keeps(),
            "pooled": result.pooled(),
            "sets": {qa.name: {"questions": len(qa.questions), "ratios": result.ratios[qa.name],
                               "rows": [dataclasses.asdict(r) for r in result.rows[qa.name]]} for qa in (qa_a, qa_b)}}
