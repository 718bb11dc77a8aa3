"""`final cartridge learn`: a cartridge that knows its document's facts, in one command.

The recipe measured on the QA sets' tuning halves (bench/RESULTS.md, issue 42): fact rows (final/distill/facts.py:
every sentence asked about, answered from the document, scored by the teacher) written beside the cartridge as
OUT.facts.jsonl, then the off-policy trainer (final/distill/train.py) over them for --steps, the KV starting as the
document's own KV (below), half the steps served beside a partner cartridge (final/distill/partners.py, texts in
OUT.partners.json) so that it keeps its answers when composed with others, and at those steps trained to leave the
partner's own answers as they are (final/distill/keep.py). Nothing is generated but the four short partner texts,
so a step costs one forward and backward pass (two beside a partner): the on-policy loop (`distill`), whose
questions the model writes itself, spends most of its time sampling and, on the tuning documents, teaches the
teacher's style of answer rather than its facts. The KV starts as the document's own, cut to P positions per head
by the teacher's attention and the values refitted to it (`--init match`, final/distill/chunks.py), or as its first
P tokens where the teacher reads windows of a long document. Beside the KL, the student's hidden state after every
layer is matched to the teacher's at the rows' tokens (`--hidden`, final/distill/hidden.py), so the cartridge fits
its rows the way the document does rather than by states the model never has after it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

STEPS = 240
BATCH = 8
BESIDE = 0.5  # the share of steps beside a partner: composed, 0.73x / 0.80x of alone instead of 0.60x / 0.70x
# the weight of the partner's answers kept at those steps (final/distill/keep.py): composed, 0.82x / 1.25x of alone
# instead of 0.73x / 0.80x (brennock + kestrel tune halves), 19 questions of 45 right instead of 16
KEEP = 1.0
# the weight of matching the teacher's hidden states (final/distill/hidden.py): tune halves 42 of 67 questions
# instead of 37 (bench/RESULTS.md, issue 42)
HIDDEN = 4.0
PARTNERS = 4  # partner texts written when --beside > 0 (final/distill/partners.py)
# SmolLM2's context before its extension to 8,192 tokens: past it the whole-document teacher reads the document
# at every row for little gain (the measured cost and answers: _check_length's note, bench/RESULTS.md).
# A notice, not a switch: the gap in answers is within noise, the gap in cost is not.
LONG_DOCUMENT = 2048


def register_learn(sub: Any) -> None:
    from final.training.start.chunks import INITS
    from final.training.document.facts import ANSWERS, DEFAULT_KINDS, KINDS
    from final.training.live import LiveConfig
    from final.training.train import TrainConfig
    from final.training.commands import _model_args

    p = sub.add_parser("learn", help="a cartridge of a document's facts: fact rows from every sentence, then "
                                     "off-policy training (the recipe measured on QA accuracy)")
    p.add_argument("--text", required=True, type=Path, help="the document the cartridge will stand for")
    p.add_argument("--tokens", required=True, type=int, help="P: the cartridge's length in tokens")
    p.add_argument("--out", required=True, type=Path, help="the cartridge (+ OUT.facts.jsonl, OUT.ckpt)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps (default {STEPS})")
    p.add_argument("--batch", type=int, default=BATCH, help=f"rows per step (default {BATCH})")
    p.add_argument("--lr", type=float, default=TrainConfig.lr,
                   help=f"Adam's learning rate (default {TrainConfig.lr})")
    _teacher_args(p)
    p.add_argument("--fact-kinds", type=lambda v: tuple(x.strip() for x in v.split(",") if x.strip()),
                   default=DEFAULT_KINDS, help=f"rows to make, of {', '.join(KINDS)} (default "
                                               f"{','.join(DEFAULT_KINDS)})")
    p.add_argument("--cloze-context", type=int, default=0, metavar="N",
                   help="sentences before a cloze row's blanked one, quoted with it (default 0)")
    p.add_argument("--answers", choices=ANSWERS, default="document",
                   help="a row's answer: the document's own words (default) or the teacher's greedy answer")
    p.add_argument("--answer-tokens", type=int, metavar="N",
                   help="with --answers teacher: the most tokens of an answer (default 64)")
    _partner_args(p)
    p.add_argument("--hard", type=float, default=0.0, metavar="W",
                   help="also train the rows' own tokens by cross-entropy at weight W beside the KL to the teacher "
                        "(default 0)")
    p.add_argument("--on-policy", type=float, default=0.0, metavar="F",
                   help="F of each step's rows are fact questions the cartridge being trained answers itself, scored "
                        "by the row's teacher (final/distill/live.py; default 0: the fact rows only)")
    p.add_argument("--sample-temperature", type=float, metavar="T",
                   help=f"with --on-policy: the cartridge's sampling temperature (default {LiveConfig.temperature})")
    p.add_argument("--sample-tokens", type=int, metavar="N",
                   help=f"with --on-policy: the most tokens of a sampled answer (default {LiveConfig.answer_tokens})")
    _training_args(p)
    p.add_argument("--init", choices=INITS,
                   help="the KV's start: the document's first P tokens (prefix), or its own KV cut per head from "
                        "each --start-tokens chunk by its rows' attention (select), values then refitted (match) "
                        "(final/distill/chunks.py); default: match, or prefix where the start would be cut from "
                        "--teacher-tokens windows. A cartridge to be served beside others: select (it composed "
                        "better and answered less alone, bench/RESULTS.md)")
    p.add_argument("--start-tokens", type=int, metavar="N",
                   help="with --init select|match: cut the start from the document's N-token chunks (default: "
                        "--teacher-tokens, the windows the rows' teacher reads; 0: the whole document, as without "
                        "--teacher-tokens)")
    p.add_argument("--top-k", type=int, default=20, help="teacher logprobs kept per target token (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu",
                   help="where the gradient, the rows' teacher and the on-policy samples run: cpu or cuda[:N]")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _model_args(p)
    p.set_defaults(cartridge_func=_learn)


def _teacher_args(p: argparse.ArgumentParser) -> None:
    """The flags of what each row's teacher reads: the whole document, or a window of it."""
    p.add_argument("--teacher-tokens", type=int, metavar="N",
                   help="teach each row from the N-token window of the document around its sentence instead of "
                        "the whole document (for documents longer than the model reads well: past "
                        f"{LONG_DOCUMENT:,} tokens learn prints a note; 256 measured)")
    p.add_argument("--teacher-tiles", action="store_true",
                   help="with --teacher-tokens: teach each row from the document's fixed N-token tile (tiles "
                        "overlapping by half) that holds its sentence nearest its middle: a few prefills a document "
                        "instead of one a sentence, so windows of thousands of tokens are affordable")


def _training_args(p: argparse.ArgumentParser) -> None:
    """The flags of what the cartridge's gradient step trains, beside the KL to the teacher."""
    from final.training.train import TrainConfig

    p.add_argument("--key-lr", type=float, default=TrainConfig.key_lr, metavar="F",
                   help=f"the keys' learning rate as a share of --lr (default {TrainConfig.key_lr:g}; 0: the start's "
                        "keys are kept and only the values trained)")
    p.add_argument("--hidden", type=float, metavar="W",
                   help="also match, at weight W, the teacher's hidden state after every layer at the rows' tokens "
                        "(final/distill/hidden.py): the whole document's, or with --teacher-tokens each row's own "
                        f"window's (default {HIDDEN:g}, or 0 with --teacher-tokens; 0: the KL only)")
    p.add_argument("--average", type=float, default=TrainConfig.average, metavar="F",
                   help="write the mean of the cartridge over the last F of the steps instead of the last step's "
                        f"(default {TrainConfig.average:g}: the last step's); the checkpoint keeps the last step's")


def _partner_args(p: argparse.ArgumentParser) -> None:
    """The flags of training for composition: steps beside a partner, and what is trained at them."""
    from final.training.quiet import MEASURES

    p.add_argument("--beside", type=float, default=BESIDE, metavar="F",
                   help="train F of the steps beside another cartridge (of a text the model writes), in front "
                        f"or after, so the cartridge still answers when composed (default {BESIDE}; 0: alone)")
    p.add_argument("--keep-partner", type=float, metavar="W",
                   help="at the steps beside a partner, also train at weight W that the partner's own questions are "
                        f"answered as with the partner alone (default {KEEP} beside partners; 0: not)")
    p.add_argument("--quiet-partner", type=float, default=0.0, metavar="W",
                   help="at the steps beside a partner, also train at weight W the cartridge's loudness to the "
                        "partner's questions down (final/distill/quiet.py; default 0: not)")
    p.add_argument("--quiet-by", choices=MEASURES,
                   help="with --quiet-partner: what is trained down - the loudness to the partner's questions "
                        "(the default), the attention mass they give our keys, or that loudness over our loudness "
                        "to our own questions beside the partner (ratio)")


def _learn(args: argparse.Namespace) -> int:
    from final.training.document.facts import FactConfig
    from final.training.train import TrainConfig, train_cartridge
    from final.training.commands import open_engine, read_text

    text = read_text(args.text)
    _only_with(args, ("answer_tokens",), args.answers == "teacher", "--answers teacher")
    _only_with(args, ("sample_temperature", "sample_tokens"), bool(args.on_policy), "--on-policy")
    _only_with(args, ("quiet_by",), bool(args.quiet_partner), "--quiet-partner")
    start_tokens = _start_tokens(args)  # checked before any row is written
    init = _init(args, start_tokens)
    _only_with(args, ("start_tokens",), init != "prefix", "--init select or match")
    facts = FactConfig(kinds=args.fact_kinds, cloze_context=args.cloze_context, teacher_tokens=args.teacher_tokens,
                       teacher_tiles=args.teacher_tiles,
                       top_k=args.top_k, seed=args.seed, answers=args.answers,
                       answer_tokens=FactConfig.answer_tokens if args.answer_tokens is None else args.answer_tokens)
    facts.check()
    _check_length(args, text, facts, whole_start=start_tokens is None and init != "prefix")
    train = TrainConfig(tokens=args.tokens, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                        beside=args.beside, keep=_keep(args), quiet=args.quiet_partner,
                        quiet_by=args.quiet_by or "loudness", hard=args.hard, on_policy=args.on_policy,
                        key_lr=args.key_lr, hidden=_hidden(args), average=args.average)
    train.check()
    live = _live_config(args)
    data = args.out.with_name(args.out.name + ".facts.jsonl")
    made_with = {"text_sha256": hashlib.sha256(text.encode()).hexdigest(), "model": args.model,
                 "facts": _recorded(facts)}
    partners = args.out.with_name(args.out.name + ".partners.json")
    t0 = time.perf_counter()
    if data.is_file():  # a rerun (a resumed training) keeps the rows its checkpoint was trained on...
        _check_made_with(data, made_with)  # ...if they were made from this document with these settings
    need_partners = train.beside and not partners.is_file()
    # the engine writes what is missing and, for on-policy rows, samples and scores through the training
    opened = not data.is_file() or need_partners or train.on_policy
    inference = open_engine(args, device=args.device)[0] if opened else None
    source = None
    try:
        _write_inputs(inference, text, facts, made_with, data, partners if need_partners else None, args.tokens)
        texts = json.loads(partners.read_text()) if train.beside else []
        if train.on_policy:
            from final.training.live import LiveFacts

            source = LiveFacts(inference, text, facts, live)
        summary = train_cartridge(args.model, data, args.out, train, text=text, device=args.device,
                                  dtype=args.dtype, source_document=str(args.text), progress=not args.quiet,
                                  partners=texts, live=source, init=init, chunk_tokens=start_tokens,
                                  teacher_tokens=args.teacher_tokens, teacher_tiles=args.teacher_tiles)
    finally:
        if source is not None:
            source.close()
        if inference is not None:
            inference.shutdown()
    print(f"wrote {summary['out']} ({summary['tokens']} tokens): KL {summary['first_kl']:.4f} -> "
          f"{summary['last_kl']:.4f} over {summary['steps']} steps on {summary['conversations']} rows "
          f"({(time.perf_counter() - t0) / 60:.1f} min in all)")
    return 0


def _check_length(args: argparse.Namespace, text: str, facts: Any, whole_start: bool) -> None:
    """Before any work: refuse a document shorter than the cartridge, or one that the whole-document teacher (or
    the start cut from the whole document) cannot read with a row after it in the model's context window - naming
    the way that can; and say so (on stderr) where the whole document, past LONG_DOCUMENT tokens, will be every
    row's teacher: the run costs several times the windows' and the user may not know --teacher-tokens exists."""
    from transformers import AutoTokenizer

    from final.training.document.facts import end_of_turn, fact_prompts, prompt_ids
    from final.errors import CartridgeError
    from final.models import model_positions, resolve_model_path
    from final.prompts import document_ids

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
        fix = "--teacher-tokens 256" if args.teacher_tokens is None else "--start-tokens 256 (or --init prefix)"
        reader = "every row's teacher" if args.teacher_tokens is None else "the start (--start-tokens 0)"
        raise CartridgeError(f"is {n:,} tokens and its longest fact row {row:,} more: {reader} reads both, past the "
                             f"model's context window of {window:,}; pass {fix} to read it in 256-token windows",
                             file=str(args.text), field="text")
    if args.teacher_tokens is None and n > LONG_DOCUMENT:
        print(f"note: {args.text} is {n:,} tokens, past the {LONG_DOCUMENT:,} the model reads well; every row's "
              "teacher reads all of it, which makes this run several times longer than with --teacher-tokens 256 "
              "(each row taught from its 256-token window; on a 6,706-token document 24 min against 88 on 2 "
              "cores, as many questions right within noise: bench/RESULTS.md)", file=sys.stderr)


def _recorded(facts: Any) -> dict:
    """The fact settings a rerun must match; the answers' settings only where they are not the document's words,
    and the word rows' count only where they are made, so that rows made before either existed still resume."""
    out = dataclasses.asdict(facts)
    if facts.answers == "document":
        del out["answers"], out["answer_tokens"]
    if "word" not in facts.kinds:
        del out["words"]
    if not facts.teacher_tiles:
        del out["teacher_tiles"]
    return out


def _only_with(args: argparse.Namespace, keys: tuple[str, ...], used: bool, needs: str) -> None:
    """A flag that sets something only another flag uses is refused without it, naming the flag (not ignored)."""
    from final.errors import CartridgeError

    for key in keys:
        if getattr(args, key) is not None and not used:
            raise CartridgeError(f"--{key.replace('_', '-')} has no effect without {needs}", field=key)


def _init(args: argparse.Namespace, start_tokens: int | None) -> str:
    """--init as given, else what answered most alone (bench/RESULTS.md, issue 42): `match` where the start is cut
    from the whole document (two fresh documents: 45 of 88 right, `select` 34, the first P tokens 35), `prefix`
    where it would be cut from the teacher's windows (skarrow: 0.32 against `select` per window's 0.21).
    Composed, `match` keeps least (26 of 88 against `select`'s 36): its least-squares values, 3x the document's
    own in norm, disturb a neighbour's questions; the help names `select` for cartridges served together."""
    if args.init is not None:
        return args.init
    return "prefix" if start_tokens else "match"


def _start_tokens(args: argparse.Namespace) -> int | None:
    """The chunk size the select / match start is cut from: --start-tokens (0: the whole document), else the
    teacher's windows (None: the whole document)."""
    from final.training.document.facts import MIN_WINDOW
    from final.errors import CartridgeError

    if args.start_tokens is None:
        return args.teacher_tokens
    if args.start_tokens != 0 and args.start_tokens < MIN_WINDOW:
        raise CartridgeError(f"must be 0 (the whole document) or at least {MIN_WINDOW}, got {args.start_tokens}",
                             field="start_tokens")
    return args.start_tokens or None


def _live_config(args: argparse.Namespace) -> Any:
    """The on-policy rows' sampling settings (LiveConfig's defaults where a flag is not given)."""
    from final.training.live import LiveConfig

    live = LiveConfig(temperature=LiveConfig.temperature if args.sample_temperature is None
                      else args.sample_temperature,
                      answer_tokens=LiveConfig.answer_tokens if args.sample_tokens is None else args.sample_tokens)
    live.check()
    return live


def _hidden(args: argparse.Namespace) -> float:
    """--hidden as given, else HIDDEN where the rows' teacher is the whole document; under --teacher-tokens (each row
    matched to its own window's states, final.training.hidden.WindowTeacher) 0 unless given: not measured as the
    default there yet."""
    if args.hidden is None:
        return 0.0 if args.teacher_tokens else HIDDEN
    return args.hidden


def _keep(args: argparse.Namespace) -> float:
    """--keep-partner as given (refused by TrainConfig.check with --beside 0), else KEEP beside partners."""
    if args.keep_partner is not None:
        return args.keep_partner
    return KEEP if args.beside else 0.0


def _write_inputs(inference: Any, text: str, facts: Any, made_with: dict, data: Path, partners: Path | None,
                  tokens: int) -> None:
    """What the training reads and a rerun keeps, where missing: the fact rows (with the settings they were made
    with) and, when `partners` is given, the partner texts."""
    from final.training.document.facts import write_fact_rows
    from final.training.compose import partner_texts

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
    from final.errors import CartridgeError

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
