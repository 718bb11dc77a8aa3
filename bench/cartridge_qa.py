"""Do cartridges know their documents? QA accuracy and KL per method and p on the question sets (data/qa).

    .venv/bin/python bench/cartridge_qa.py [--sets brennock,kestrel,lake_ivra] [--split tune] [--tokens 64]
        [--command learn|distill] [--chunk-tokens N] [--work DIR] [--label NAME] [-- flags...]

For each set: `final cartridge learn` (or `distill`: --command) of its document at p = --tokens with the flags
given after `--` (none: the defaults; e.g. `-- --settings FILE`), timed, then final.training.evaluate.accuracy on
the set's --split half (tune unless told: the test half is for final figures only) - no document, the first p
and 8p tokens, the whole document, the cartridge - MC acc / acc_norm, open answers, KL to the whole document, 95%
intervals. Prints a table per set, one pooled over the sets (every question counted once) and the pooled MC acc by
the kind of answer (a name, a number, an ordinary word: what the fact rows ask about differs by kind), and writes
summary.json in --work. Runs resume: a finished cartridge in --work is evaluated again without training (its
minutes are read back from summary.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from final.cartridge_commands import main as cli  # noqa: E402 - after the repository is on the path
from final.cartridges.service import CartridgeService  # noqa: E402
from final.inf import local_engine  # noqa: E402
from final.models import DEFAULT_MODEL  # noqa: E402
from final.training.document.facts import NUMBER_WORDS  # noqa: E402
from final.training.evaluate.accuracy import qa_evaluate, table  # noqa: E402
from final.training.evaluate.questions import load_qa  # noqa: E402

QA = ROOT / "data" / "qa"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sets", default="brennock,kestrel,lake_ivra")
    p.add_argument("--split", choices=("tune", "test", "all"), default="tune")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--command", choices=("learn", "distill"), default="learn",
                   help="how the cartridge is trained (default learn, the fact recipe)")
    p.add_argument("--chunk-tokens", type=int, help="add the relevant-chunk row (each question after the N-token "
                                                    "window around its support alone)")
    p.add_argument("--work", type=Path, default=Path("/tmp/cartridge_qa"))
    p.add_argument("--label", help="the method's name in the table (default: the command, with its flags)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    args = p.parse_args(argv)
    args.label = args.label or " ".join([args.command, *extra])
    args.work.mkdir(parents=True, exist_ok=True)
    summary_path = args.work / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    pooled: dict[str, list] = {}
    kinds: dict[str, str] = {}  # question id -> its answer's kind
    for name in args.sets.split(","):
        rows, minutes, questions = run_set(name, args, extra, summary.get(name, {}).get("minutes"))
        summary[name] = {"minutes": minutes, "command": args.command, "flags": extra, "split": args.split,
                         "rows": [dataclasses.asdict(r) for r in rows]}
        summary_path.write_text(json.dumps(summary, indent=2))
        print(f"\n{name} ({args.split}, {rows[0].questions} questions; {args.label}: {minutes:.1f} min)")
        print(table(rows), flush=True)
        for r in rows:
            pooled.setdefault(r.condition, []).append(r)
        kinds.update({q.id: answer_kind(q.reference) for q in questions})
    print(f"\npooled over {args.sets} ({args.split}):")
    print("| condition | questions | MC acc | MC acc_norm | open: contains | KL |\n|---|---:|---:|---:|---:|---:|")
    for cond, rs in pooled.items():
        n = sum(r.questions for r in rs)
        acc, norm, contains, kl = (sum(getattr(r, key) * r.questions for r in rs) / n
                                   for key in ("acc", "acc_norm", "contains", "kl"))
        print(f"| {cond} | {n} | {acc:.3f} | {norm:.3f} | {contains:.3f} | {kl:.3f} |")
    print_by_kind(pooled, kinds)
    return 0


def answer_kind(reference: str) -> str:
    """What a question's answer is: a number (digits or a number word), a name (capitalised) or an ordinary word."""
    if re.search(r"\d", reference) or re.search(rf"\b(?:{NUMBER_WORDS})\b", reference.lower()):
        return "number"
    return "name" if re.search(r"\b[A-Z]", reference) else "word"


def print_by_kind(pooled: dict[str, list], kinds: dict[str, str]) -> None:
    """MC acc right / asked per answer kind and condition, pooled over the sets (QARow.right names the ids)."""
    order = ("name", "number", "word")
    total = {k: sum(v == k for v in kinds.values()) for k in order}
    print("\nMC acc by the kind of answer (right / asked):")
    print("| condition | " + " | ".join(order) + " |\n|---|" + "---:|" * len(order))
    for cond, rs in pooled.items():
        right = [i for r in rs for i in r.right]
        print(f"| {cond} | " + " | ".join(f"{sum(kinds.get(i) == k for i in right)} / {total[k]}" for k in order)
              + " |")


def run_set(name: str, args: argparse.Namespace, extra: list[str], minutes: float | None):
    qa = load_qa(QA / f"{name}.jsonl", None if args.split == "all" else args.split)
    out = args.work / f"{name}_p{args.tokens}.pt"
    if minutes is None or not out.is_file():
        t0 = time.perf_counter()
        code = cli(["cartridge", args.command, "--model", args.model, "--text", str(QA / f"{name}.txt"),
                    "--tokens", str(args.tokens), "--out", str(out), "--quiet", *extra])
        if code:
            raise SystemExit(code)
        minutes = (time.perf_counter() - t0) / 60
    inference = local_engine(args.model, dtype="float32")
    try:
        cart = CartridgeService(inference.engine, inference.model_dir).read_served(out)
        return qa_evaluate(inference, qa.document, qa.questions, cart, chunk_tokens=args.chunk_tokens), minutes, \
            qa.questions
    finally:
        inference.shutdown()


if __name__ == "__main__":
    sys.exit(main())
