"""Does a cartridge answer its own training rows? Teacher-forced fit against free answers, per row kind.

    .venv/bin/python experiments/cartridge_rows.py CART.pt [--rows CART.pt.facts.jsonl] [--n 40] [--seed 1] [--show]

A cartridge can fit its rows' KL closely and still answer users' questions no better (bench/RESULTS.md, issue 42's
long document): this tells the two apart on a random sample of the rows it was trained on (`learn` writes them
beside the cartridge as OUT.facts.jsonl). Per kind (quote, cloze, ask):
  - teacher-forced, over the answer tokens: the KL to the teacher (its top-k and one bucket for the rest, as
    training reports it), how often the cartridge's most likely token is the row's own token, and how often the
    teacher's is (the ceiling); the KL over the question tokens too;
  - free: the cartridge's greedy answer (40 tokens) to the row's question, counted right where it names a fact of
    the row's answer: for a quote row one of the names or numbers of its sentences that the question does not name,
    for a cloze / ask row the cue. `--teacher-rows` (rows of the same document made with `learn --answers
    teacher`, whose answers are the teacher's own greedy ones) counts the teacher's answers to the same questions
    the same way: what the model says with the document's window in context.
Reads only what it is given; contacts nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def forced(inference, cid: str, rows: list[dict]) -> dict:
    """Per kind: question KL, answer KL (losses.forward_topk_tail, the KL training reports), the cartridge's and
    the teacher's top-1 agreement with the row's tokens."""
    from final.training.losses import Targets, forward_topk_tail

    engine = inference.engine
    prefix = engine.prefixes.get((cid,))
    out: dict = {}
    for r in rows:
        ids = r["prompt_ids"] + r["answer_ids"]
        logits, _ = engine.call(lambda runner, ids=ids: runner.forward_full(ids, prefix))
        first = len(ids) - len(r["top_ids"])  # the first target token (the rows' targets run to the end)
        logq = torch.log_softmax(logits[first - 1:len(ids) - 1].float(), -1)  # the positions predicting them
        n = len(r["top_ids"])
        own = torch.tensor(ids[first:])
        t = Targets(torch.tensor(r["top_ids"]), torch.tensor(r["top_logprobs"]), own, torch.zeros(n),
                    torch.zeros(n, dtype=torch.bool))
        kl = forward_topk_tail(logq, t)[1]
        answer = torch.arange(first, len(ids)) >= len(r["prompt_ids"])
        s = out.setdefault(r["seed_type"], {"q_kl": [], "a_kl": [], "top1": [], "teacher_top1": []})
        s["q_kl"] += kl[~answer].tolist()
        s["a_kl"] += kl[answer].tolist()
        s["top1"] += (logq.argmax(-1) == own)[answer].tolist()
        s["teacher_top1"] += (t.top_ids[:, 0] == own)[answer].tolist()
    return out


def names_a_fact(row: dict, text: str) -> bool:
    """The answer `text` names a fact of the row's answer (see the module's docstring)."""
    from final.training.document.facts import cues

    if row["seed_type"] != "quote":
        return row["answer"].strip().lower() in text.lower()
    facts = [c for c in cues(row["answer"]) if c.lower() not in row["question"].lower()]
    return any(c.lower() in text.lower() for c in facts)


def free(inference, cid: str, rows: list[dict], teacher: dict, show: bool) -> dict:
    """Per kind: [cartridge right, teacher right, teacher asked, asked] of the greedy answers to the rows' own
    questions (`teacher`: question -> the teacher's answer, where known)."""
    got = inference.generate([[{"role": "user", "content": r["question"]}] for r in rows], cartridge=[cid],
                             temperature=0.0, max_tokens=40)
    out: dict = {}
    for r, text in zip(rows, got.completions):
        ok = names_a_fact(r, text)
        tally = out.setdefault(r["seed_type"], [0, 0, 0, 0])
        tally[0] += ok
        if r["question"] in teacher:
            tally[1] += names_a_fact(r, teacher[r["question"]])
            tally[2] += 1
        tally[3] += 1
        if show:
            print(f"{r['seed_type']:5} {'right' if ok else 'wrong'} | {r['question'][:80]} | {r['answer'][:50]!r} | "
                  f"{text[:80]!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cartridge", type=Path)
    p.add_argument("--rows", type=Path, help="the training rows (default: CART.facts.jsonl beside the cartridge)")
    p.add_argument("--n", type=int, default=40, help="rows sampled (default 40)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--teacher-rows", type=Path, help="rows of the same document made with --answers teacher")
    p.add_argument("--show", action="store_true", help="print each free answer")
    p.add_argument("--model", default="builtin:smollm2-135m-instruct")
    args = p.parse_args(argv)
    from final.inf import local_engine

    path = args.rows or args.cartridge.with_name(args.cartridge.name + ".facts.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = random.Random(args.seed).sample(rows, min(args.n, len(rows)))
    teacher = {}
    if args.teacher_rows:
        for line in args.teacher_rows.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                teacher[row["question"]] = row["answer"]
    inference = local_engine(args.model, dtype="float32")
    try:
        cid = inference.load_cartridge("rows-check", path=str(args.cartridge))
        fit, said = forced(inference, cid, rows), free(inference, cid, rows, teacher, args.show)
    finally:
        inference.shutdown()
    print("| kind | rows | question KL | answer KL | top-1 = row's token (cartridge / teacher) | free answers naming "
          "a fact: cartridge | teacher |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
    for kind, s in sorted(fit.items()):
        right, t_right, t_asked, asked = said.get(kind, (0, 0, 0, 0))
        print(f"| {kind} | {asked} | {mean(s['q_kl']):.3f} | {mean(s['a_kl']):.3f} | {mean(s['top1']):.2f} / "
              f"{mean(s['teacher_top1']):.2f} | {right} of {asked} | "
              f"{f'{t_right} of {t_asked}' if t_asked else '-'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
