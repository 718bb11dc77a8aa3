"""A question set cut to a part of its document: the first N paragraphs, and the questions answered there.

    .venv/bin/python experiments/qa_part.py --set skarrow --paragraphs 19 --out W/skq

Writes OUT.txt (the document's first N blank-line-separated paragraphs) and OUT.jsonl (the set's questions whose
`support` passage lies inside them, both halves, as they are), so `final cartridge learn --text OUT.txt` and
`final cartridge eval CART --qa OUT.jsonl --split all` ask a cartridge of the part about the part. Why: on a long
document a cartridge can fall short for two reasons that a part tells apart - the text is more than the model
reads in context, or the recipe is (bench/RESULTS.md: skarrow's first 1,784 tokens). Reads only data/qa.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

QA = Path(__file__).resolve().parent / "qa"


def cut(text: str, rows: list[dict], paragraphs: int) -> tuple[str, list[dict]]:
    """The first `paragraphs` paragraphs of `text`, and the rows whose support passage is inside them."""
    part = "\n\n".join(text.split("\n\n")[:paragraphs]).rstrip() + "\n"
    return part, [r for r in rows if r.get("support") and r["support"] in part]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", required=True, help="a set of data/qa (NAME.txt and NAME.jsonl)")
    p.add_argument("--paragraphs", type=int, required=True, help="how many of the document's paragraphs to keep")
    p.add_argument("--out", type=Path, required=True, help="OUT.txt and OUT.jsonl are written")
    args = p.parse_args(argv)
    if args.paragraphs < 1:
        p.error("--paragraphs must be at least 1")
    text = (QA / f"{args.set}.txt").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in (QA / f"{args.set}.jsonl").read_text(encoding="utf-8").splitlines() if line]
    part, kept = cut(text, rows, args.paragraphs)
    if not kept:
        print(f"no question of {args.set} is answered in its first {args.paragraphs} paragraphs", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".txt").write_text(part, encoding="utf-8")
    args.out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    halves = {s: sum(r.get("split") == s for r in kept) for s in ("tune", "test")}
    print(f"wrote {args.out.with_suffix('.txt')} ({len(part):,} characters) and {len(kept)} questions "
          f"({halves['tune']} tune, {halves['test']} test) to {args.out.with_suffix('.jsonl')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
