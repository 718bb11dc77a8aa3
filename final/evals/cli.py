"""`final eval <benchmark>` (also runnable as `python -m final.evals.cli <benchmark> ...`).

  gsm8k --data FILE [--limit N] [--tools [tools.yaml]]   GSM8K accuracy (veRL's scorer), tool-call rate, turns, tok/s
  verl [--data FILE | --verl-config YAML] [KEY=VALUE ...]  veRL's validation metrics on a veRL dataset (parquet)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from final.cli import run_command
from final.evals import gsm8k, verl_eval


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `eval` command (with its benchmarks) to an argparse subparsers object."""
    parser = subparsers.add_parser("eval", help="run a benchmark through the rollout contract")
    sub = parser.add_subparsers(dest="eval_name", required=True)
    gsm8k.register(sub)
    verl_eval.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m final.evals.cli")
    sub = parser.add_subparsers(dest="eval_name", required=True)
    gsm8k.register(sub)
    verl_eval.register(sub)
    args = parser.parse_args(argv)
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
