"""`final cartridge learn`: a cartridge that knows its document's facts, in one command (the recipe to use).

1. rows: every sentence of the document asked about (final/training/document/facts.py: quote and cloze rows),
   answered by the document's own words and scored by the teacher (the model with the document as its system
   turn, or with the row's --teacher-tokens window of it), written beside the cartridge as OUT.facts.jsonl;
2. start: the document's own KV cut to P positions per head (match: values refitted; final/training/start);
3. training: the off-policy trainer (final/training/train.py) over the rows, the KL to the teacher plus its hidden
   states (hidden.py), half the steps beside a partner cartridge so that it still answers composed (compose.py).
Nothing is generated but four short partner texts, so a step costs one forward and backward pass (two beside a
partner). Why each default: bench/RESULTS.md, "Does a cartridge know its document?"; what lost: experiments/.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from final.errors import CartridgeError
from final.models import model_positions, resolve_model_path
from final.prompts import document_ids
from final.training.compose import PARTNERS, partner_texts
from final.training.document.facts import end_of_turn, fact_prompts, prompt_ids, write_fact_rows
from final.training.inputs import open_engine, read_settings_file, read_text
from final.training.settings import FactConfig, LearnSettings, TrainConfig
from final.training.train import train_cartridge

KEEP = 1.0  # the weight of a partner's own answers kept beside it (RESULTS, "Composition")
HIDDEN = 4.0  # the weight of the teacher's hidden states (RESULTS, "Matching the teacher's hidden states")
# SmolLM2's context before its extension to 8,192 tokens: past it the whole-document teacher reads the document at
# every row for little gain (RESULTS, "The long document"): a notice, not a switch
LONG_DOCUMENT = 2048


def run(args: argparse.Namespace) -> int:
    text = read_text(args.text)
    recipe = read_settings_file(args.settings, LearnSettings)
    init = args.init or ("prefix" if args.teacher_tokens else "match")
    facts = FactConfig(teacher_tokens=args.teacher_tokens, top_k=recipe.top_k, seed=args.seed)
    facts.check()
    train = TrainConfig(tokens=args.tokens, steps=args.steps, batch=recipe.batch, lr=recipe.lr, seed=args.seed,
                        beside=recipe.beside, keep=_keep(recipe), hidden=_hidden(recipe, args.teacher_tokens))
    train.check()
    if train.hidden and args.teacher_tokens:
        raise CartridgeError("the hidden states are the whole document's teacher's: with --teacher-tokens set "
                             "hidden: 0 (matching each window's states lost: experiments/README.md)", field="hidden")
    _check_length(args, text, facts, whole_start=init != "prefix")
    data = args.out.with_name(args.out.name + ".facts.jsonl")
    partners = args.out.with_name(args.out.name + ".partners.json")
    made_with = {"text_sha256": hashlib.sha256(text.encode()).hexdigest(), "model": args.model,
                 "facts": dataclasses.asdict(facts)}
    t0 = time.perf_counter()
    if data.is_file():  # a rerun (a resumed training) keeps the rows its checkpoint was trained on...
        _check_made_with(data, made_with)  # ...if they were made from this document with these settings
    need_partners = bool(train.beside) and not partners.is_file()
    if not data.is_file() or need_partners:  # the engine writes what is missing
        inference = open_engine(args.model, args.dtype, args.device)
        try:
            _write_inputs(inference, text, facts, made_with, data, partners if need_partners else None, args.tokens)
        finally:
            inference.shutdown()
    summary = train_cartridge(args.model, data, args.out, train, text=text, device=args.device, dtype=args.dtype,
                              source_document=str(args.text), progress=not args.quiet,
                              partners=json.loads(partners.read_text()) if train.beside else [], init=init)
    print(f"wrote {summary['out']} ({summary['tokens']} tokens): KL {summary['first_kl']:.4f} -> "
          f"{summary['last_kl']:.4f} over {summary['steps']} steps on {summary['conversations']} rows "
          f"({(time.perf_counter() - t0) / 60:.1f} min in all)")
    return 0


def _keep(recipe: LearnSettings) -> float:
    """keep_partner as given (refused by TrainConfig.check without steps beside a partner), else KEEP beside them."""
    if recipe.keep_partner is not None:
        return recipe.keep_partner
    return KEEP if recipe.beside else 0.0


def _hidden(recipe: LearnSettings, teacher_tokens: int | None) -> float:
    """hidden as given, else HIDDEN where the rows' teacher is the whole document, 0 where it reads windows."""
    if recipe.hidden is not None:
        return recipe.hidden
    return 0.0 if teacher_tokens else HIDDEN


def _check_length(args: argparse.Namespace, text: str, facts: FactConfig, whole_start: bool) -> None:
    """Before any work: refuse a document shorter than the cartridge, or one that the whole-document teacher (or
    the start cut from the whole document) cannot read with a row after it in the model's context window, naming
    the flag that can; and say so (on stderr) where the whole document, past LONG_DOCUMENT tokens, will teach
    every row: the run costs several times the windows' and the user may not know --teacher-tokens exists."""
    model_dir = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    n, window, end = len(document_ids(tok, text)), model_positions(model_dir), end_of_turn(tok)
    if n < args.tokens:
        raise CartridgeError(f"{args.text} renders to {n:,} tokens as a system turn, fewer than --tokens "
                             f"{args.tokens:,}: a cartridge stands for at most its document's tokens (pass --tokens "
                             f"{n:,} or fewer)", field="tokens")
    if args.teacher_tokens is not None and not whole_start:
        return
    row = max((sum(map(len, prompt_ids(tok, fp, end))) for fp in fact_prompts(text, facts)), default=0)
    if n + row >= window:
        fix = "--teacher-tokens 256" if args.teacher_tokens is None else "--init prefix"
        reader = "every row's teacher" if args.teacher_tokens is None else f"the {args.init or 'match'} start"
        raise CartridgeError(f"is {n:,} tokens and its longest fact row {row:,} more: {reader} reads both, past the "
                             f"model's context window of {window:,}; pass {fix} to read it in windows",
                             file=str(args.text), field="text")
    if args.teacher_tokens is None and n > LONG_DOCUMENT:
        print(f"note: {args.text} is {n:,} tokens, past the {LONG_DOCUMENT:,} the model reads well; every row's "
              "teacher reads all of it, which makes this run several times longer than with --teacher-tokens 256 "
              "(each row taught from its 256-token window; bench/RESULTS.md, \"The long document\")",
              file=sys.stderr)


def _write_inputs(inference, text: str, facts: FactConfig, made_with: dict, data: Path, partners: Path | None,
                  tokens: int) -> None:
    """What the training reads and a rerun keeps, where missing: the fact rows (with the settings they were made
    with) and, when `partners` is given, the partner texts."""
    t0 = time.perf_counter()
    if not data.is_file():
        tmp = data.with_name(data.name + ".tmp")
        tmp.unlink(missing_ok=True)
        rows = write_fact_rows(inference, text, tmp, facts)
        _meta(data).write_text(json.dumps(made_with, indent=2))
        tmp.replace(data)
        print(f"wrote {rows} fact rows to {data} ({time.perf_counter() - t0:.0f} s)")
    if partners is not None:
        partners.write_text(json.dumps(partner_texts(inference, PARTNERS, tokens), indent=2))


def _meta(data: Path) -> Path:
    return data.with_name(data.name + ".json")


def _check_made_with(data: Path, made_with: dict) -> None:
    """Rows made from another document, model or fact settings would train the wrong cartridge: refuse them."""
    meta = _meta(data)
    try:
        recorded = json.loads(meta.read_text())
    except (OSError, ValueError):
        recorded = None
    want = json.loads(json.dumps(made_with))  # tuples as lists, as read back
    if recorded != want:
        changed = sorted(k for k in want if not isinstance(recorded, dict) or recorded.get(k) != want[k])
        raise CartridgeError(f"{data.name} was made with other settings ({', '.join(changed)} differ, or {meta.name} "
                             "is missing): remove it and the checkpoint, or choose another --out", file=str(data),
                             field="out")
