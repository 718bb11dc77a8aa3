"""`final cartridge ...` (also `python -m final.cartridge_commands cartridge ...`): the cartridge library's commands
(final/cartridge_files.py) and the training package's (final/training/commands.py).

  build   --text FILE --out PATH     prefill the text, save its KV as a cartridge (+ manifest beside it)
  inspect PATH                       print the cartridge's shape, dtype, tokens and manifest; check the checksum
  verify  PATH --text FILE           compare cartridge + question with text + question: max logit diff, agreement
  convert IN OUT                     rewrite a cartridge as .pt or .safetensors (by OUT's suffix), with a manifest
  learn   --text FILE --tokens P --out PATH    a cartridge of the document's facts (the recipe to use)
  train   --data JSONL --tokens P --out PATH   train a cartridge on rows you have (traces', or your own)
  traces  --gsm8k FILE --tools FILE --out JSONL   tool-use rows from the multi-turn path
  distill --text FILE --tokens P --out PATH    on-policy: the student samples, final is the teacher
  eval    PATH --qa QA.jsonl [--compose CART_B --compose-qa QA_B.jsonl]   QA accuracy against the baselines

Each command names the function that runs it ("module:function"), imported when it runs: parsing stays light.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

from final.cli import run_command
from final.models import DEFAULT_MODEL
from final.training import commands as training


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `cartridge` command and its subcommands to an argparse subparsers object."""
    parser = subparsers.add_parser("cartridge", help="build, inspect, verify, train and judge cartridges (trained "
                                                     "KV caches)")
    sub = parser.add_subparsers(dest="cartridge_command", required=True)
    _library(sub)
    training.register(sub)
    parser.set_defaults(func=run)
    return parser


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model path or builtin name (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="float32", help="engine dtype (float32: HF's numbers to ~1e-4; auto, bf16)")
    p.add_argument("--raw", action="store_true", help="plain text instead of a chat system turn")


def _library(sub: Any) -> None:
    b = sub.add_parser("build", help="build a cartridge by prefilling a text")
    b.add_argument("--text", required=True, type=Path, help="document text file")
    b.add_argument("--out", required=True, type=Path, help="output .pt (cartridges-repo layout) or .safetensors")
    b.add_argument("--id", help="cartridge id recorded in the manifest (default: the output file's stem)")
    b.add_argument("--frozen-tokens", type=int, default=1, help="leading tokens stored as frozen (default 1)")
    b.add_argument("--save-dtype", help="dtype of the saved tensors (default: the engine dtype)")
    _model_args(b)
    b.set_defaults(cartridge_run="final.cartridge_files:build")

    i = sub.add_parser("inspect", help="print a cartridge's shape and manifest; verify its checksum")
    i.add_argument("path", type=Path)
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(cartridge_run="final.cartridge_files:inspect")

    v = sub.add_parser("verify", help="check cartridge + question against text + question")
    v.add_argument("path", type=Path)
    v.add_argument("--text", required=True, type=Path, help="the document the cartridge was built from")
    v.add_argument("--question", action="append", help="question (repeatable; default: three generic ones)")
    v.add_argument("--max-new-tokens", type=int, default=32)
    v.add_argument("--json", action="store_true", help="print JSON")
    v.add_argument("--tolerance", type=float, help="exit 1 if the max logit diff exceeds this or an answer differs")
    _model_args(v)
    v.set_defaults(cartridge_run="final.cartridge_files:verify")

    c = sub.add_parser("convert", help="rewrite a cartridge as .pt or .safetensors (chosen by the output suffix)")
    c.add_argument("path", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--save-dtype", help="dtype of the written tensors (default: unchanged)")
    c.set_defaults(cartridge_run="final.cartridge_files:convert")


def run(args: argparse.Namespace) -> int:
    module, _, name = args.cartridge_run.partition(":")
    return run_command(getattr(importlib.import_module(module), name), args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="final")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
