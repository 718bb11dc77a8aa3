"""One DAgger round over a document's fact questions: the cartridge's own greedy answers, scored by the teacher.

    .venv/bin/python bench/cartridge_own_answers.py CART.pt --text doc.txt --out rows.jsonl [--teacher-tokens N]
        [--answer-tokens 40]

`learn` teaches a cartridge the document's words teacher-forced; answering freely it leaves that path
(bench/cartridge_rows.py). Here each of `learn`'s questions (final/distill/facts.py, the default kinds and seed) is
answered by the cartridge itself, greedily, and the teacher - the document as its system turn, or the N-token
window around the row's sentence (`--teacher-tokens`, as `learn`'s) - scores every token of the answer, so a
cartridge trained on the rows learns what the teacher would say where its own answers go wrong. Appends the rows
to --out (ids from 100000, kind "<kind>-own"), to be trained beside `learn`'s rows with `final cartridge train`
(bench/RESULTS.md, issue 42's long document). Contacts nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def own_answers(inference, cart: Path, questions: list[str], tokens: int, end: int) -> list[list[int]]:
    """The cartridge's greedy answers, closed by `end` where it stopped (facts.closed_answer)."""
    from final.training.document.facts import closed_answer

    cid = inference.load_cartridge("own-answers", path=str(cart))
    try:
        got = inference.generate([[{"role": "user", "content": q}] for q in questions], cartridge=[cid],
                                 temperature=0.0, max_tokens=tokens)
    finally:
        inference.unload_cartridge(cid)
    return [closed_answer(row, end) for row in got.rows()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cartridge", type=Path)
    p.add_argument("--text", type=Path, required=True, help="the document the cartridge stands for")
    p.add_argument("--out", type=Path, required=True, help="rows appended here (JSONL)")
    p.add_argument("--teacher-tokens", type=int, metavar="N", help="the teacher's window (default: whole document)")
    p.add_argument("--answer-tokens", type=int, default=40)
    p.add_argument("--model", default="builtin:smollm2-135m-instruct")
    args = p.parse_args(argv)
    from final.training.rows import append
    from final.training.document.facts import FactConfig, end_of_turn, fact_prompts, fact_rows
    from final.inf import local_engine

    text = args.text.read_text()
    cfg = FactConfig(teacher_tokens=args.teacher_tokens)
    inference = local_engine(args.model, dtype="float32")
    t0 = time.perf_counter()
    try:
        questions = [fp.question for fp in fact_prompts(text, cfg)]
        answers = own_answers(inference, args.cartridge, questions, args.answer_tokens,
                              end_of_turn(inference.tokenizer))
        rows = fact_rows(inference, text, cfg, given=answers)
        for row in rows:  # told apart from learn's rows beside them
            row.id, row.seed_type = row.id + 100000, row.seed_type + "-own"
        append(args.out, rows)
    finally:
        inference.shutdown()
    print(f"wrote {len(rows)} rows of the cartridge's own answers to {args.out} "
          f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
