"""What `final cartridge build | inspect | verify | convert` do: each a few calls of the cartridge library
(final/cartridges: build, format, manifest, service) on a file, the engine from InferenceEngine where one is needed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from final.cartridges.build import (DEFAULT_QUESTIONS, build_from_text, continuation_ids, document_ids,
                                    read_document, verify as verify_cartridge)
from final.cartridges.format import dtype_name, load_cartridge, save_cartridge
from final.cartridges.manifest import (CartridgeManifest, check_matches_manifest, manifest_path, read_manifest,
                                       verify_checksum)
from final.cartridges.service import CartridgeService
from final.engine.engine import resolve_dtype


def build(args: argparse.Namespace) -> int:
    from final.inf import local_engine  # veRL: only the commands that run the model load it

    text = read_document(args.text, "text")
    inference = local_engine(args.model, dtype=args.dtype)
    try:
        cart = build_from_text(inference.engine, document_ids(inference.tokenizer, text, chat=not args.raw),
                               args.frozen_tokens)
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


def inspect(args: argparse.Namespace) -> int:
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


def verify(args: argparse.Namespace) -> int:
    from final.inf import local_engine  # veRL: only the commands that run the model load it

    text = read_document(args.text, "text")
    inference = local_engine(args.model, dtype=args.dtype)
    engine, tok = inference.engine, inference.tokenizer
    try:
        cart, _ = CartridgeService(engine).read(args.path, _manifest_of(args.path))
        chat = not args.raw
        questions = args.question or list(DEFAULT_QUESTIONS)
        report = verify_cartridge(engine, cart, document_ids(tok, text, chat=chat),
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


def convert(args: argparse.Namespace) -> int:
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
    m = manifest_path(path)
    return m if m.is_file() else None
