"""`final cartridge ...` (also runnable as `python -m final.cartridge_commands ...`); the training commands' flags and
handlers are in final/distill/train_cli.py.

  build   --text FILE --out PATH     prefill the text, save its KV as a cartridge (+ manifest beside it)
  inspect PATH                       print the cartridge's shape, dtype, tokens and manifest; check the checksum
  verify  PATH --text FILE           compare cartridge + question with text + question: max logit diff, agreement
  convert IN OUT                     rewrite a cartridge as .pt or .safetensors (by OUT's suffix), with a manifest
  synth   --text FILE --out JSONL    self-study: the model asks and answers questions about chunks (resumable)
  train   --data JSONL --text FILE --tokens P --out PATH   distil the conversations into a P-token cartridge
  learn   --text FILE --tokens P --out PATH    a cartridge of the document's facts: fact rows, then training
  distill --text FILE --tokens P --out PATH    on-policy: the student samples, final is the teacher (resumable)
  eval    PATH --qa QA.jsonl [--data JSONL]  QA accuracy (and KL): no doc, first P and K*P tokens, whole doc,
                                     cartridge [, the relevant chunk alone: --chunk-tokens N]
  eval    PATH --qa QA.jsonl --compose CART_B --compose-qa QA_B.jsonl   two cartridges served together
                                     (final.training.evaluate.composed): alone, composed, in context, both in context
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "builtin:smollm2-135m-instruct"


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `cartridge` command (with build/inspect/verify) to an argparse subparsers object."""
    parser = subparsers.add_parser("cartridge", help="build, inspect and verify cartridges (trained KV caches)")
    sub = parser.add_subparsers(dest="cartridge_command", required=True)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default=DEFAULT_MODEL, help=f"model path or builtin name (default {DEFAULT_MODEL})")
        p.add_argument("--dtype", default="float32", help="engine dtype (float32: HF's numbers to ~1e-4; auto, bf16)")
        p.add_argument("--raw", action="store_true", help="plain text instead of a chat system turn")

    b = sub.add_parser("build", help="build a cartridge by prefilling a text")
    b.add_argument("--text", required=True, type=Path, help="document text file")
    b.add_argument("--out", required=True, type=Path, help="output .pt (cartridges-repo layout) or .safetensors")
    b.add_argument("--id", help="cartridge id recorded in the manifest (default: the output file's stem)")
    b.add_argument("--frozen-tokens", type=int, default=1, help="leading tokens stored as frozen (default 1)")
    b.add_argument("--save-dtype", help="dtype of the saved tensors (default: the engine dtype)")
    model_args(b)
    b.set_defaults(cartridge_func=_build)

    i = sub.add_parser("inspect", help="print a cartridge's shape and manifest; verify its checksum")
    i.add_argument("path", type=Path)
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(cartridge_func=_inspect)

    v = sub.add_parser("verify", help="check cartridge + question against text + question")
    v.add_argument("path", type=Path)
    v.add_argument("--text", required=True, type=Path, help="the document the cartridge was built from")
    v.add_argument("--question", action="append", help="question (repeatable; default: three generic ones)")
    v.add_argument("--max-new-tokens", type=int, default=32)
    v.add_argument("--json", action="store_true", help="print JSON")
    v.add_argument("--tolerance", type=float, help="exit 1 if the max logit diff exceeds this or an answer differs")
    model_args(v)
    v.set_defaults(cartridge_func=_verify)

    c = sub.add_parser("convert", help="rewrite a cartridge as .pt or .safetensors (chosen by the output suffix)")
    c.add_argument("path", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--save-dtype", help="dtype of the written tensors (default: unchanged)")
    c.set_defaults(cartridge_func=_convert)
    from final.training.learn import register_learn
    from final.training.commands import register_training

    register_training(sub)
    register_learn(sub)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from final.cli import run_command

    return run_command(args.cartridge_func, args)


def _open_engine(args: argparse.Namespace):
    from final.training.commands import open_engine

    return open_engine(args)


def _read_text(path: Path) -> str:
    from final.training.commands import read_text

    return read_text(path)


def _build(args: argparse.Namespace) -> int:
    import torch

    from final.cartridges.build import build_from_text, document_ids
    from final.cartridges.format import save_cartridge
    from final.cartridges.manifest import CartridgeManifest
    from final.engine.engine import resolve_dtype

    text = _read_text(args.text)
    inference, engine, tok = _open_engine(args)
    try:
        cart = build_from_text(engine, document_ids(tok, text, chat=not args.raw), args.frozen_tokens)
    finally:
        inference.shutdown()
    if args.save_dtype:
        cart = cart.to(resolve_dtype(args.save_dtype, torch.device("cpu")))
    out = save_cartridge(cart, args.out)
    manifest = CartridgeManifest.describe(cart, out, cartridge_id=args.id or out.stem, model_id=args.model,
                                          source_document=str(args.text),
                                          labels={"format": "raw" if args.raw else "chat"})
    mpath = manifest.write(out)
    print(f"wrote {out} ({cart.num_tokens} tokens, {cart.num_layers} layers, {manifest.dtype}, {manifest.size} bytes)"
          f" and {mpath}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from final.cartridges.format import dtype_name, load_cartridge
    from final.cartridges.manifest import check_matches_manifest, manifest_path, read_manifest, verify_checksum

    mpath = manifest_path(args.path)
    manifest = read_manifest(mpath) if mpath.is_file() else None
    if manifest is not None:
        verify_checksum(args.path, manifest)
    cart = load_cartridge(args.path, allow_nonfinite=True)
    if manifest is not None:
        check_matches_manifest(cart, manifest, str(args.path))
    info = {"path": str(args.path), "num_layers": cart.num_layers, "num_kv_heads": cart.num_kv_heads,
            "head_dim": cart.head_dim, "num_tokens": cart.num_tokens, "num_frozen_tokens": cart.num_frozen_tokens,
            "dtype": dtype_name(cart.dtype), "nbytes": cart.nbytes,
            "finite": all(bool(t.isfinite().all()) for t in cart.keys + cart.values),
            "manifest": manifest.__dict__ if manifest else None, "checksum": "ok" if manifest else "no manifest"}
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            if key != "manifest":
                print(f"{key:18} {value}")
        if manifest:
            print(f"{'manifest':18} {mpath}")
            for key, value in manifest.__dict__.items():
                print(f"  {key:16} {value}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from final.cartridges.build import DEFAULT_QUESTIONS, continuation_ids, document_ids, verify
    from final.cartridges.service import CartridgeService

    text = _read_text(args.text)
    inference, engine, tok = _open_engine(args)
    try:
        cart, _ = CartridgeService(engine).read(args.path, _manifest_of(args.path))
        chat = not args.raw
        questions = args.question or list(DEFAULT_QUESTIONS)
        report = verify(engine, cart, document_ids(tok, text, chat=chat),
                        [continuation_ids(tok, q, chat=chat) for q in questions], args.max_new_tokens)
    finally:
        inference.shutdown()
    if args.json:
        print(json.dumps({"max_logit_diff": report.max_logit_diff, "token_agreement": report.token_agreement,
                          "same_answers": report.same_answers, "questions": len(report.checks),
                          "per_question": [{"question": q, "max_logit_diff": c.max_logit_diff,
                                            "agreement": c.agreement, "same_answer": c.same_answer}
                                           for q, c in zip(questions, report.checks)]}, indent=2))
    else:
        for q, c in zip(questions, report.checks):
            print(f"{c.max_logit_diff:.3e}  agreement {c.agreement:.3f}  {'same' if c.same_answer else 'DIFF'}  {q}")
        print(f"max logit diff: {report.max_logit_diff:.3e}")
        print(f"token agreement: {report.token_agreement:.4f} ({report.same_answers}/{len(report.checks)} same answer)")
    if args.tolerance is None:
        return 0
    return int(report.max_logit_diff > args.tolerance or report.same_answers < len(report.checks))


def _convert(args: argparse.Namespace) -> int:
    import torch

    from final.cartridges.format import load_cartridge, save_cartridge
    from final.cartridges.manifest import CartridgeManifest, read_manifest, verify_checksum
    from final.engine.engine import resolve_dtype

    mpath = _manifest_of(args.path)
    old = read_manifest(mpath) if mpath else None
    if old is not None:
        verify_checksum(args.path, old)
    cart = load_cartridge(args.path, allow_nonfinite=True)
    if args.save_dtype:
        cart = cart.to(resolve_dtype(args.save_dtype, torch.device("cpu")))
    out = save_cartridge(cart, args.out)
    new = CartridgeManifest.describe(cart, out, cartridge_id=old.cartridge_id if old else out.stem,
                                     model_id=old.model_id if old else "",
                                     source_document=old.source_document if old else None,
                                     labels=old.labels if old else None)
    print(f"wrote {out} and {new.write(out)}")
    return 0


def _manifest_of(path: Path) -> Path | None:
    from final.cartridges.manifest import manifest_path

    m = manifest_path(path)
    return m if m.is_file() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="final")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
