"""`final cartridge synth | train | distill | eval`: the flags and handlers of the training commands (the
`cartridge` command itself, with build/inspect/verify/convert, is final/distill/cli.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "builtin:smollm2-135m-instruct"


def open_engine(args: argparse.Namespace):
    """The embedded engine (through InferenceEngine, the one composition root) and its tokenizer."""
    from final.inf import local_engine

    inference = local_engine(args.model, dtype=args.dtype)
    return inference, inference.engine, inference.tokenizer


def read_text(path: Path) -> str:
    from final.errors import CartridgeError

    if not path.is_file():
        raise CartridgeError("text file does not exist", file=str(path), field="text")
    return path.read_text()


def chunk_range(value: str) -> tuple[int, int]:
    """--chunk-tokens MIN-MAX (or one number for both)."""
    lo, _, hi = value.partition("-")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN-MAX or N, got {value!r}") from None


def _model_args(p: argparse.ArgumentParser, dtype: str = "float32") -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model path or builtin name (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default=dtype, help=f"model dtype (default {dtype}; auto: bf16 on CUDA, else fp32)")


def _question_args(p: argparse.ArgumentParser, chunk: str, question_tokens: int) -> None:
    p.add_argument("--chunk-tokens", type=chunk_range, default=chunk_range(chunk),
                   help=f"each chunk's length, drawn in MIN-MAX (default {chunk}; the repo: 512-4096)")
    p.add_argument("--question-tokens", type=int, default=question_tokens)
    p.add_argument("--cot-probability", type=float, default=0.2,
                   help="share of questions given a chain-of-thought instruction (default 0.2, the repo's)")
    p.add_argument("--plain-system", action="store_true",
                   help="the chunk alone in the system turn, not in the repo's system-prompt template")
    p.add_argument("--top-k", type=int, default=20, help="teacher logprobs kept per target token (default 20)")
    p.add_argument("--seed-types", type=lambda v: tuple(x.strip() for x in v.split(",") if x.strip()),
                   help="self-study seed prompts to draw from, comma-separated (default: all of structuring, "
                        "summarization, question, use_case, creative; e.g. question for fact questions only)")
    p.add_argument("--supervise", choices=("all", "answer"), default="all",
                   help="targets: every token after the system turn (default, the repo's) or the answer's only")


def register_training(sub: Any) -> None:
    s = sub.add_parser("synth", help="self-study: synthesize conversations about a document (resumable JSONL)")
    s.add_argument("--text", required=True, type=Path, help="document text file")
    s.add_argument("--out", required=True, type=Path, help="JSONL to append to (rows already there are kept)")
    s.add_argument("--config", help="InferenceEngine config (any backend); default: the local engine on --model")
    s.add_argument("--count", type=int, default=64, help="conversations in the file when done (default 64)")
    s.add_argument("--batch", type=int, default=16, help="conversations per chunk (default 16)")
    _question_args(s, "512-2048", 128)
    s.add_argument("--answer-tokens", type=int, default=256)
    s.add_argument("--temperature", type=float, default=0.6, help="question sampling temperature (default 0.6)")
    s.add_argument("--answer-temperature", type=float, default=0.0, help="teacher temperature (default 0)")
    s.add_argument("--seed", type=int, default=0, help="chunks, seed prompts and sampling (another seed: held-out)")
    _model_args(s)
    s.set_defaults(cartridge_func=_synth)

    t = sub.add_parser("train", help="distil synthesized conversations into a trained cartridge (resumable)")
    t.add_argument("--data", required=True, type=Path,
                   help="JSONL from `final cartridge synth` (teacher top-k) or `traces` (hard targets)")
    t.add_argument("--text", type=Path, help="the document (its first P tokens initialise the KV; default: the "
                                             "first conversation's first P tokens)")
    t.add_argument("--init-text", type=Path, help="initialise from this (unrelated) text's first P tokens instead")
    t.add_argument("--tokens", required=True, type=int, help="P: the cartridge's length in tokens")
    t.add_argument("--out", required=True, type=Path, help="output .pt (cartridges-repo layout) or .safetensors")
    t.add_argument("--steps", type=int, default=100)
    t.add_argument("--batch", type=int, default=4, help="conversations per step (default 4)")
    t.add_argument("--lr", type=float, default=2e-2)
    t.add_argument("--frozen-tokens", type=int, default=1, help="leading tokens kept fixed (default 1, the sink)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (OUT.ckpt)")
    t.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    t.add_argument("--save-dtype", help="dtype of the saved tensors (default: the model's)")
    t.add_argument("--id", help="cartridge id recorded in the manifest (default: the output file's stem)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    _model_args(t, "auto")
    t.set_defaults(cartridge_func=_train)
    _register_distill(sub)
    _register_traces(sub)
    _register_eval(sub)


def _register_eval(sub: Any) -> None:
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
    e.add_argument("--limit", type=int, help="use only the first N conversations")
    e.add_argument("--json", action="store_true", help="print JSON")
    _model_args(e)
    e.set_defaults(cartridge_func=_eval)


def _register_distill(sub: Any) -> None:
    d = sub.add_parser("distill", help="on-policy distillation: the student samples with the current cartridge, "
                                       "final (the document as a cartridge) is the teacher (resumable)")
    d.add_argument("--text", required=True, type=Path, help="the document the cartridge will stand for")
    d.add_argument("--tokens", required=True, type=int, help="P: the cartridge's length in tokens")
    d.add_argument("--out", required=True, type=Path, help="the cartridge, rewritten after every step (+ OUT.ckpt)")
    d.add_argument("--steps", type=int, default=40)
    d.add_argument("--questions", type=int, default=8, help="questions per step (default 8)")
    d.add_argument("--n", type=int, default=1, help="student samples per question (default 1)")
    d.add_argument("--temperature", type=float, default=1.0, help="the student's sampling temperature")
    d.add_argument("--answer-tokens", type=int, default=128)
    d.add_argument("--loss", help="on the student's own tokens: forward_topk, forward_topk_tail, reverse_k1 or "
                                  "reverse_k3 (default: DistillConfig's; see docs/guides/train-cartridge.md)")
    d.add_argument("--on-policy-fraction", type=float, default=1.0,
                   help="share of each step's questions the student answers; the rest the teacher (off-policy)")
    d.add_argument("--lr", type=float,
                   help="Adam's learning rate (default: DistillConfig's, measured: docs/guides/train-cartridge.md)")
    d.add_argument("--schedule", help="the lr over --steps: cosine (DistillConfig's default) decays it to 0 at the "
                                      "last step, constant keeps it")
    d.add_argument("--updates", type=int, default=1, help="Adam steps on each step's rows (default 1)")
    d.add_argument("--init", help="the cartridge's start: prefix (the document's first P tokens), select (each "
                                  "KV head's P most attended positions of the whole document) or match (select's "
                                  "positions, values fitted to the teacher's attention; default: DistillConfig's)")
    d.add_argument("--init-questions", type=int,
                   help="select/match: how many teacher-answered self-study conversations' attention picks the "
                        "positions (default: DistillConfig's)")
    d.add_argument("--validate", type=int,
                   help="teacher-answered conversations, never trained on, that judge the cartridge at each "
                        "checkpoint; OUT ends as the best judged, the start included (0: the last step's; "
                        "default: DistillConfig's)")
    d.add_argument("--frozen-tokens", type=int, default=1)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--checkpoint-every", type=int, default=5)
    d.add_argument("--rollout", choices=("engine", "verl"), default="engine",
                   help="engine: sample in-process; verl: veRL's AgentLoopManager through the tokasaurus replica "
                        "against `final serve` (started here unless --server)")
    d.add_argument("--server", help="with --rollout verl: a running `final serve` URL that can read --out")
    d.add_argument("--config", help="InferenceEngine config for the teacher and in-process rollouts (any backend)")
    d.add_argument("--device", default="cpu", help="where the gradient runs: cpu or cuda[:N]")
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    _question_args(d, "512-2048", 64)
    _model_args(d)
    d.set_defaults(cartridge_func=_distill)


def _register_traces(sub: Any) -> None:
    r = sub.add_parser("traces", help="tool-use conversations: GSM8K problems played through the multi-turn path "
                                      "with the real tools (hard targets for `train`)")
    r.add_argument("--gsm8k", required=True, type=Path, help="GSM8K JSONL (question, answer ending '#### N')")
    r.add_argument("--tools", required=True, type=Path, help="tools.yaml with the calc_gsm8k_reward tool")
    r.add_argument("--out", required=True, type=Path, help="JSONL to write (must not exist)")
    r.add_argument("--skip", type=int, default=0, help="leave out the first N problems (e.g. those you evaluate on)")
    r.add_argument("--count", type=int, help="problems to use after --skip (default: all)")
    r.add_argument("--config", help="InferenceEngine config whose rollout (chat template, multi_turn) the traces "
                                    "follow (default: the package's)")
    r.add_argument("--model", default=None, help="override model_path")
    r.add_argument("--student", type=Path, help="a tool-use cartridge: rows from what the model writes behind it "
                                                "(its reasoning as context, the call and answer as targets)")
    r.add_argument("--student-tokens", type=int, default=256, help="the student's first-turn limit (default 256)")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(cartridge_func=_traces)


def _traces(args: argparse.Namespace) -> int:
    from final.config import load_config
    from final.distill.traces import build_traces
    from final.errors import ConfigError

    if not args.tools.is_file():
        raise ConfigError("tools file does not exist", key="--tools", path=str(args.tools))
    overrides: dict[str, Any] = {"rollout": {"multi_turn": {"enable": True, "tool_config_path": str(args.tools)}}}
    model = {"model_path": args.model} if args.model else {}
    config = load_config(args.config, {**overrides, **model})
    student = None
    if args.student:
        from final.inf import InferenceEngine

        if not args.student.is_file():
            raise ConfigError("cartridge file does not exist", key="--student", path=str(args.student))
        student = (InferenceEngine(args.config, **model), str(args.student))
    try:
        summary = build_traces(config, args.gsm8k, args.out, skip=args.skip, count=args.count,
                               progress=not args.quiet, student=student, student_tokens=args.student_tokens)
    finally:
        if student:
            student[0].shutdown()
    print(f"wrote {summary['rows']} rows ({summary['problems']} problems, {summary['targets']} target tokens of "
          f"{summary['tokens']}) to {summary['out']}")
    return 0


def _synth_config(args: argparse.Namespace, **kw: Any):
    from final.distill.synth import SynthConfig

    return SynthConfig(min_chunk_tokens=args.chunk_tokens[0], max_chunk_tokens=args.chunk_tokens[1],
                       question_tokens=args.question_tokens, top_k=args.top_k, cot_probability=args.cot_probability,
                       supervise=args.supervise, template=None if args.plain_system else SynthConfig.template,
                       **({"seed_types": args.seed_types} if args.seed_types else {}), **kw)


def _inference(args: argparse.Namespace):
    if args.config:
        from final.inf import InferenceEngine

        return InferenceEngine(args.config)
    return open_engine(args)[0]


def _synth(args: argparse.Namespace) -> int:
    from final.distill.synth import synthesize

    text = read_text(args.text)
    cfg = _synth_config(args, count=args.count, batch=args.batch, answer_tokens=args.answer_tokens,
                        question_temperature=args.temperature, answer_temperature=args.answer_temperature,
                        seed=args.seed)
    cfg.check()
    inference = _inference(args)
    try:
        written = synthesize(inference, text, args.out, cfg)
    finally:
        inference.shutdown()
    print(f"wrote {written} conversations to {args.out} ({cfg.count} in all)")
    return 0


def _train(args: argparse.Namespace) -> int:
    import torch

    from final.distill.train import TrainConfig, train_cartridge
    from final.engine.engine import resolve_dtype

    cfg = TrainConfig(tokens=args.tokens, steps=args.steps, batch=args.batch, lr=args.lr,
                      frozen_tokens=args.frozen_tokens, seed=args.seed, checkpoint_every=args.checkpoint_every)
    save = resolve_dtype(args.save_dtype, torch.device("cpu")) if args.save_dtype else None
    summary = train_cartridge(args.model, args.data, args.out, cfg,
                              text=read_text(args.text) if args.text else None,
                              init_text=read_text(args.init_text) if args.init_text else None,
                              device=args.device, dtype=args.dtype, save_dtype=save, cartridge_id=args.id,
                              source_document=str(args.text) if args.text else None, progress=not args.quiet)
    print(f"wrote {summary['out']} ({summary['tokens']} tokens, {summary['bytes']} bytes): loss "
          f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, KL {summary['first_kl']:.4f} -> "
          f"{summary['last_kl']:.4f} over {summary['steps']} steps on {summary['conversations']} conversations")
    return 0


def _distill(args: argparse.Namespace) -> int:
    from final.distill.distill import DistillConfig, distill

    text = read_text(args.text)
    given = {k: getattr(args, k) for k in ("lr", "schedule", "init", "init_questions", "validate", "loss")
             if getattr(args, k) is not None}
    cfg = DistillConfig(**given,  # a flag left out keeps DistillConfig's default (one place for them)
                        tokens=args.tokens, steps=args.steps, questions=args.questions, n=args.n,
                        temperature=args.temperature, answer_tokens=args.answer_tokens, top_k=args.top_k,
                        updates=args.updates, on_policy_fraction=args.on_policy_fraction,
                        supervise=args.supervise, frozen_tokens=args.frozen_tokens, seed=args.seed,
                        checkpoint_every=args.checkpoint_every, rollout=args.rollout,
                        synth=_synth_config(args, seed=args.seed))
    cfg.check()
    inference = _inference(args)
    try:
        history = distill(inference, text, args.out, cfg, model=args.model, device=args.device, dtype=args.dtype,
                          server=args.server, progress=not args.quiet)
    finally:
        inference.shutdown()
    first, last = history[0], history[-1]
    print(f"wrote {args.out} ({cfg.tokens} tokens): loss {first['loss']:.4f} -> {last['loss']:.4f}, KL "
          f"{first['forward_kl']:.4f} -> {last['forward_kl']:.4f} over {len(history)} steps")
    if "kept_step" in last:
        print(f"validation KL {first.get('start_validation_kl', float('nan')):.4f} at the start; {args.out} holds "
              f"the best judged, after step {last['kept_step']} ({last['kept_validation_kl']:.4f})")
    return 0


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
        cart = CartridgeService(engine, inference.model_dir).read_served(args.path, positions=args.positions)
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


def _eval_qa(args: argparse.Namespace, inference: Any, cart: Any) -> dict:
    import dataclasses

    from final.distill.qa import load_qa
    from final.distill.qa_eval import qa_evaluate, table

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
    from final.distill.qa import load_qa
    from final.distill.qa_compose import ComposeSet, compose_evaluate, compose_table

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
            "sets": {qa.name: {"questions": len(qa.questions), "ratios": result.ratios[qa.name],
                               "rows": [dataclasses.asdict(r) for r in result.rows[qa.name]]} for qa in (qa_a, qa_b)}}


def _eval_kl(args: argparse.Namespace, inference: Any, cart: Any) -> dict:
    import dataclasses

    from final.distill.convs import dedupe, read_conversations
    from final.distill.evaluate import evaluate, table
    from final.distill.synth import teacher_ids

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
