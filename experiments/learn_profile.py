"""Where a `final cartridge learn` run spends its time: the wall seconds inside each part of a training step.

    .venv/bin/python experiments/learn_profile.py -- --text data/qa/kestrel.txt --tokens 64 --out W/k.pt --steps 30

Everything after `--` is `final cartridge learn`'s own arguments (run as the CLI runs it). Each part is timed where
it is called: the teacher's hidden states (`HiddenTeacher.states`, the forward over the document and the rows, and
`KeptStates.states`, what `learn` calls: the kept rows read back, the rest passed through), the student's gradient
step (`Trainer.step`: forward, backward and Adam, a partner's rows included), and the batch's assembly. Take it on
a quiet machine: two cores shared with anything else distort it several-fold (bench/RESULTS.md, "Abbreviations,
and the teacher's states kept").
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TIMED = collections.defaultdict(float)
CALLS: collections.Counter = collections.Counter()


def timed(owner: Any, name: str, label: str) -> None:
    """Wrap owner.name so each call adds its wall time to TIMED[label] (none where a commit lacks it: KeptStates
    came in dfcb3e5, and the script is run at earlier commits to compare)."""
    original: Callable | None = getattr(owner, name, None)
    if original is None:
        return

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            TIMED[label] += time.perf_counter() - start
            CALLS[label] += 1

    setattr(owner, name, wrapper)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("learn", nargs=argparse.REMAINDER, help="-- then `final cartridge learn`'s arguments")
    args = ap.parse_args(argv)
    learn = args.learn[1:] if args.learn[:1] == ["--"] else args.learn
    from final.training import hidden, train, trainer
    from final.cartridge_commands import main as cli

    timed(hidden.HiddenTeacher, "states", "teacher forward (HiddenTeacher.states)")
    timed(getattr(hidden, "KeptStates", None), "states", "teacher states as learn reads them (KeptStates)")
    timed(trainer.Trainer, "step", "gradient step (Trainer.step)")
    timed(train, "make_batch", "batch assembly (make_batch)")
    start = time.perf_counter()
    rc = cli(["cartridge", "learn", "--quiet", *learn])
    total = time.perf_counter() - start
    print(f"learn rc={rc}, {total:.1f} s in all")
    for label, seconds in sorted(TIMED.items(), key=lambda kv: -kv[1]):
        print(f"{label:50s} {seconds:7.1f} s {CALLS[label]:5d} calls {seconds / CALLS[label]:7.3f} s a call")
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
