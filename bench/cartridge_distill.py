"""Held-out KL against wall time: on-policy, mixed and off-policy distillation of one document into a cartridge.

    .venv/bin/python bench/cartridge_distill.py [--tokens 64] [--steps 40] [--modes on,mixed,off] [--every 10]

One loop (final.training.onpolicy.loop, what `final cartridge distill` runs) at equal compute per step - the same
questions per step, the same answer budget - differing only in who answers: the student with its current cartridge
(`on`, on_policy_fraction 1), half and half (`mixed`, 0.5), or the teacher (`off`, 0: self-study made on the fly).
Every --every steps the cartridge is judged on held-out questions (synthesized with another seed, deduplicated
against every training question) by `final.training.evaluate.heldout`: KL per answer token to the teacher that reads the
whole document, beside the document's first p tokens and no document. Evaluation time is not counted in the wall
time. Prints a table per mode, the cost split of a step, and writes summary.json in --work.
The document is bench/data/vellmark.txt (original text written for this benchmark, ~1,500 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "bench" / "data" / "vellmark.txt"
FRACTION = {"on": 1.0, "mixed": 0.5, "off": 0.0}


def heldout(inference, text: str, work: Path, args: argparse.Namespace):
    from final.training.rows import read_conversations
    from final.training.onpolicy.selfstudy import SynthConfig, synthesize

    path = work / "heldout.jsonl"
    cfg = SynthConfig(count=args.heldout, batch=args.heldout_batch, min_chunk_tokens=512, max_chunk_tokens=2048,
                      question_tokens=64, answer_tokens=args.heldout_answer_tokens, seed=10_000 + args.seed,
                      supervise="answer")
    synthesize(inference, text, path, cfg, progress=False)
    return read_conversations(path, len(inference.tokenizer))


def judge(inference, text: str, rows, cart) -> dict:
    from final.training.evaluate.heldout import evaluate
    from final.prompts import document_ids

    out = evaluate(inference.engine, inference.tokenizer, document_ids(inference.tokenizer, text), cart, rows)
    return dict(zip(("no document", "first_p", "cartridge"), (r.kl for r in out)))


def run_mode(inference, text: str, mode: str, rows, work: Path, args: argparse.Namespace) -> dict:
    from final.training.rows import dedupe
    from final.training.onpolicy.loop import DistillConfig, distill
    from final.training.onpolicy.selfstudy import SynthConfig
    from final.training.train import checkpoint_path

    cfg = DistillConfig(tokens=args.tokens, steps=args.steps, questions=args.questions,
                        answer_tokens=args.answer_tokens, on_policy_fraction=FRACTION[mode], loss=args.loss,
                        updates=args.updates, init=args.init, lr=args.lr, schedule=args.schedule,
                        temperature=args.temperature,
                        seed=args.seed, validate=args.validate,
                        synth=SynthConfig(min_chunk_tokens=args.chunk_tokens[0], max_chunk_tokens=args.chunk_tokens[1],
                                          question_tokens=64))
    points, clock, seen = [], {"train_s": 0.0}, []

    def on_step(rec: dict, cache) -> None:
        clock["train_s"] += sum(rec.get(k, 0.0) for k in ("init_s", "validation_set_s", "question_s", "rollout_s",
                                                            "teacher_s", "gradient_s", "sync_s", "validation_s"))
        seen.extend(rec.get("questions", []))
        if "init_s" in rec and points and points[0]["step"] == 0:  # the initial cartridge cost init_s to make
            points[0]["wall_s"] = round(rec["init_s"], 1)
        if rec["step"] % args.every == 0 or rec["step"] == args.steps:
            kl = judge(inference, text, dedupe(rows, seen), cache.cartridge())
            points.append({"step": rec["step"], "wall_s": round(clock["train_s"], 1), **kl})
            print(f"[{mode}] step {rec['step']}: {json.dumps(points[-1])}", flush=True)

    def on_start(done: int, cache) -> None:  # the initial cartridge (step 0), judged as every later one
        if done == 0:
            points.append({"step": 0, "wall_s": 0.0, **judge(inference, text, rows, cache.cartridge())})
            print(f"[{mode}] step 0: {json.dumps(points[-1])}", flush=True)

    out = work / f"{mode}-p{args.tokens}.pt"
    for stale in (out, checkpoint_path(out)):
        stale.unlink(missing_ok=True)
    history = distill(inference, text, out, cfg, model=args.model, dtype="float32", progress=False, on_step=on_step,
                      on_start=on_start)
    from final.cartridges.format import load_cartridge

    kept = judge(inference, text, dedupe(rows, seen), load_cartridge(out))  # what OUT holds at the end
    judged = [(0, history[0].get("start_validation_kl"))] + [(r["step"], r["validation_kl"]) for r in history
                                                             if "validation_kl" in r]
    points.append({"step": "OUT", "wall_s": round(clock["train_s"], 1), **kept})
    print(f"[{mode}] OUT (validation KL by step: {judged}): {json.dumps(points[-1])}", flush=True)
    stages = ("question_s", "rollout_s", "teacher_s", "gradient_s", "sync_s")
    cost = {k: round(sum(r[k] for r in history) / len(history), 2) for k in stages}
    cost["init_s"] = round(history[0].get("init_s", 0.0), 1)
    return {"points": points, "step_cost_s": cost, "first_loss": history[0]["loss"], "last_loss": history[-1]["loss"]}


def main() -> int:
    from final.training.onpolicy.loop import DistillConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "out" / "cartridge_distill")
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--loss", default=DistillConfig.loss)
    ap.add_argument("--updates", type=int, default=1)
    ap.add_argument("--validate", type=int, default=DistillConfig.validate,
                    help="validation conversations (0: OUT is the last step's); default: the loop's")
    ap.add_argument("--init", default=DistillConfig.init, help="prefix, select or match; default: the loop's")
    ap.add_argument("--lr", type=float, default=DistillConfig.lr, help="default: the loop's")
    ap.add_argument("--schedule", default=DistillConfig.schedule, help="constant or cosine; default: the loop's")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--modes", default="on,mixed,off")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--heldout", type=int, default=48)
    ap.add_argument("--heldout-batch", type=int, default=8,
                    help="held-out questions per chunk: 48 in 8s is 6 chunks (12 from one chunk let one fact-laden "
                         "answer carry 3/4 of the KL)")
    ap.add_argument("--heldout-answer-tokens", type=int, default=128,
                    help="the held-out answers' budget (apart from --answer-tokens, so runs that train on shorter "
                         "answers are judged on the same rows)")
    ap.add_argument("--chunk-tokens", type=lambda v: tuple(int(x) for x in v.split("-")), default=(512, 2048),
                    help="MIN-MAX tokens of the chunk each training step's questions are written from")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baselines", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                    help="P1,P2,...: also judge the document's first P tokens for these P (for scale)")
    args = ap.parse_args()
    from final.inf import local_engine

    args.work.mkdir(parents=True, exist_ok=True)
    text = DOC.read_text()
    inference = local_engine(args.model, dtype="float32")
    try:
        rows = heldout(inference, text, args.work, args)
        scale = {p: first_tokens(inference, text, rows, p) for p in args.baselines}
        results = {m: run_mode(inference, text, m, rows, args.work, args) for m in args.modes.split(",")}
    finally:
        inference.shutdown()
    summary = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                           "load_1min_at_end": os.getloadavg()[0]}, "date": time.strftime("%Y-%m-%d"),
               "args": {k: str(v) for k, v in vars(args).items()}, "results": results, "first_p_tokens": scale}
    (args.work / "summary.json").write_text(json.dumps(summary, indent=2))
    print(report(results, args))
    for p, kl in scale.items():
        print(f"the document's first {p} tokens: KL {kl:.4f}")
    return 0


def first_tokens(inference, text: str, rows, p: int) -> float:
    """The held-out KL of a cartridge of the document's first p tokens (what a prefix of that size gives)."""
    from final.cartridges.build import build_from_text
    from final.prompts import document_ids

    cart = build_from_text(inference.engine, document_ids(inference.tokenizer, text)[:p])
    return judge(inference, text, rows, cart)["cartridge"]


def report(results: dict, args: argparse.Namespace) -> str:
    lines = [f"p={args.tokens}, {args.questions} questions/step, held-out KL per answer token (nats)", "",
             "| mode | step | train wall s | no document | first p tokens | cartridge | cartridge / first p |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for mode, res in results.items():
        for pt in res["points"]:
            lines.append(f"| {mode} | {pt['step']} | {pt['wall_s']} | {pt['no document']:.4f} | {pt['first_p']:.4f} "
                         f"| {pt['cartridge']:.4f} | {pt['cartridge'] / pt['first_p']:.2f}x |")
    lines += ["", "| mode | question s | rollout s | teacher s | gradient s | sync s | (mean per step) | init s |",
              "|---|---:|---:|---:|---:|---:|---|---:|"]
    for mode, res in results.items():
        c = res["step_cost_s"]
        lines.append(f"| {mode} | {c['question_s']} | {c['rollout_s']} | {c['teacher_s']} | {c['gradient_s']} | "
                     f"{c['sync_s']} | | {c['init_s']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
