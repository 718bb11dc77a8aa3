"""`final cartridge eval`: a trained cartridge judged against no document, the document's first p and k*p tokens
and the whole document - QA accuracy on a question set (--qa), a composition with a second cartridge (--compose),
KL on held-out conversations (--data)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from final.training.commands import _model_args, open_engine, read_text


def register_eval(sub: Any) -> None:
    e = sub.add_parser("eval", help="a trained cartridge against no document, the document's first p and k*p "
                                     "tokens and the whole document: QA accuracy (--qa) and KL (--data)")
    e.add_argument("path", type=Path)
    e.add_argument("--text", type=Path, help="the document the cartridge stands for (default: the --qa set's)")
    e.add_argument("--qa", type=Path, help="question set (bench/qa/NAME.jsonl, its document NAME.txt beside it): "
                                           "multiple-choice acc/acc_norm, open answers, KL, with 95%% intervals")
    e.add_argument("--split", choices=("tune", "test", "all"), default="tune",
                   help="which half of the --qa set to ask (default tune; test is for the final figures only)")
    e.add_argument("--multiple", type=int, default=8, help="k of the first-k*p-tokens row (default 8)")
    e.add_argument("--compose", type=Path, metavar="CART_B", help="a second document's cartridge: serve both "
                   "together (instead of the --qa table, a composition table per set: each cartridge alone, both "
                   "composed, each document / both documents in context, no document); needs --compose-qa")
    e.add_argument("--compose-qa", type=Path, metavar="QA_B", help="the --compose cartridge's question set "
                   "(its document QA_B.txt beside it), asked like --qa, same --split")
    e.add_argument("--one-order", action="store_true",
                   help="with --compose: both documents in context only as PATH's then CART_B's (default: both "
                        "orders; the composed cartridges are asked in one, which scores as the other)")
    e.add_argument("--open-tokens", type=int, default=32, help="greedy tokens of an open answer (default 32)")
    e.add_argument("--chunk-tokens", type=int, metavar="N",
                   help="add the relevant-chunk row: each question after the N-token window of the document "
                        "around its support span alone (default: no such row)")
    e.add_argument("--data", type=Path, help="held-out JSONL from `final cartridge synth --seed N` (KL table)")
    e.add_argument("--train-data", type=Path, action="append", default=[],
                   help="training JSONL: held-out rows asking one of its questions are dropped (repeatable)")
    e.add_argument("--positions", choices=("after_prefix", "from_zero"),
                   help="the cartridge's position convention (default: its manifest's or run config's; with "
                        "--compose, for both cartridges)")
    e.add_argument("--checkpoint", action="store_true",
                   help="PATH is a training checkpoint (OUT.ckpt of learn, train or distill): ask the cartridge as "
                        "it stood after the run's last step - the written file is the mean under --average and the "
                        "best step under validation - or a run that has not finished")
    e.add_argument("--limit", type=int, help="use only the first N conversations")
    e.add_argument("--json", action="store_true", help="print JSON")
    _model_args(e)
    e.set_defaults(cartridge_func=_eval)


def _eval(args: argparse.Namespace) -> int:
    from final.cartridges.service import CartridgeService
    from final.errors import CartridgeError

    if args.qa is None and args.data is None:
        raise CartridgeError("give --qa (questions) or --data (held-out conversations), or both", field="qa")
    if args.text is None and args.qa is None:
        raise CartridgeError("--data needs --text, the document the cartridge stands for", field="text")
    if args.multiple < 1 or args.open_tokens < 1:
        raise CartridgeError("--multiple and --open-tokens must be at least 1", field="multiple")
    _check_compose_flags(args)
    if args.chunk_tokens is not None and args.chunk_tokens < 1:
        raise CartridgeError(f"--chunk-tokens must be at least 1, got {args.chunk_tokens}", field="chunk_tokens")
    inference, engine, tok = open_engine(args)
    report: dict = {}
    try:
        cart = _read(args, CartridgeService(engine, inference.model_dir), report)
        if args.compose is not None:
            report["compose"] = _eval_compose(args, inference, cart)
        elif args.qa is not None:
            report["qa"] = _eval_qa(args, inference, cart)
        if args.data is not None:  # at the top level, where it always was
            report.update(_eval_kl(args, inference, cart))
    finally:
        inference.shutdown()
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def _read(args: argparse.Namespace, service: Any, report: dict) -> Any:
    """The cartridge PATH names, as served: a cartridge file (or run folder), or with --checkpoint the last step's
    cartridge in a training checkpoint (whose step goes in the report)."""
    from final.cartridges.manifest import check_matches_model
    from final.training.trainer import checkpoint_cartridge
    from final.errors import CartridgeError

    if not args.checkpoint:
        return service.read_served(args.path, positions=args.positions)
    if args.positions not in (None, "after_prefix"):
        raise CartridgeError("a training checkpoint's cartridge is in the training's convention, after_prefix; "
                             f"--positions {args.positions} cannot apply to it", field="positions")
    cart, step = checkpoint_cartridge(args.path)
    check_matches_model(cart, service.model, str(args.path))
    report["checkpoint_step"] = step
    if not args.json:
        print(f"{args.path}: the cartridge after step {step} (training checkpoint)")
    return cart


def _eval_qa(args: argparse.Namespace, inference: Any, cart: Any) -> dict:
    import dataclasses

    from final.training.evaluate.questions import load_qa
    from final.training.evaluate.accuracy import qa_evaluate, table

    qa = load_qa(args.qa, None if args.split == "all" else args.split, document=args.text)
    rows = qa_evaluate(inference, qa.document, qa.questions, cart, multiple=args.multiple,
                       open_tokens=args.open_tokens, chunk_tokens=args.chunk_tokens)
    if not args.json:
        print(f"{qa.name}: {len(qa.questions)} questions ({args.split})")
        print(table(rows))
    return {"set": qa.name, "split": args.split, "questions": len(qa.questions),
            "rows": [dataclasses.asdict(r) for r in rows]}


def _check_compose_flags(args: argparse.Namespace) -> None:
    """--compose and --compose-qa come together, with --qa; each file exists (checked before the model loads)."""
    from final.errors import CartridgeError

    if (args.compose is None) != (args.compose_qa is None):
        given, missing = ("compose", "compose-qa") if args.compose is not None else ("compose-qa", "compose")
        raise CartridgeError(f"--{given} needs --{missing}", field=missing)
    if args.compose is None:
        return
    if args.qa is None:
        raise CartridgeError("--compose needs --qa, the question set of the first cartridge", field="qa")
    for path, flag in ((args.compose, "compose"), (args.compose_qa, "compose-qa")):
        if not path.exists():
            raise CartridgeError("file does not exist", file=str(path), field=flag)


def _eval_compose(args: argparse.Namespace, inference: Any, cart: Any) -> dict:
    import dataclasses

    from final.cartridges.service import CartridgeService
    from final.training.evaluate.questions import load_qa
    from final.training.evaluate.composed import ComposeSet, compose_evaluate, compose_table

    split = None if args.split == "all" else args.split
    qa_a, qa_b = load_qa(args.qa, split, document=args.text), load_qa(args.compose_qa, split)
    cart_b = CartridgeService(inference.engine, inference.model_dir).read_served(args.compose,
                                                                                positions=args.positions)
    result = compose_evaluate(inference, ComposeSet(qa_a.name, qa_a.document, qa_a.questions, cart),
                              ComposeSet(qa_b.name, qa_b.document, qa_b.questions, cart_b),
                              open_tokens=args.open_tokens, both_orders=not args.one_order)
    if not args.json:
        for qa in (qa_a, qa_b):
            print(f"{qa.name}: {len(qa.questions)} questions ({args.split})")
            print(compose_table(result, qa.name))
    return {"split": args.split, "separator": result.separator, "composed": result.composed, "keeps": result.keeps(),
            "pooled": result.pooled(),
            "sets": {qa.name: {"questions": len(qa.questions), "ratios": result.ratios[qa.name],
                               "rows": [dataclasses.asdict(r) for r in result.rows[qa.name]]} for qa in (qa_a, qa_b)}}


def _eval_kl(args: argparse.Namespace, inference: Any, cart: Any) -> dict:
    import dataclasses

    from final.training.rows import dedupe, read_conversations
    from final.training.evaluate.heldout import evaluate, table
    from final.training.teacher import teacher_ids

    tok = inference.tokenizer
    text = read_text(args.text) if args.text is not None else read_text(args.qa.with_suffix(".txt"))
    seen = [r.question for path in args.train_data for r in read_conversations(path, len(tok))]
    convs = dedupe(read_conversations(args.data, len(tok)), seen)[:args.limit]
    rows = evaluate(inference.engine, tok, teacher_ids(tok, text), cart, convs)
    tokens = sum(len(c.answer_ids) for c in convs)
    if not args.json:
        print(f"{len(convs)} held-out conversations, {tokens} answer tokens")
        print(table(rows))
    return {"conversations": len(convs), "answer_tokens": tokens, "rows": [dataclasses.asdict(r) for r in rows]}
