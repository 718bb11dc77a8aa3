"""The flags of `final cartridge learn | train | traces | distill | eval`: what a user needs on the command line;
every other setting is a key of `--settings FILE` (final/training/settings.py). Each command names the function
that runs it (`cartridge_run`, "module:function"), imported only when it runs, so `final --help` parses without
loading the model code (as pip's command table does)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from final.models import DEFAULT_MODEL
from final.training.settings import INITS, ROLLOUTS, DistillConfig, LearnSettings, TrainConfig

LEARN_STEPS = 240  # `learn`'s optimizer steps: ~12 passes over a ~1,000-token document's rows


def register(sub: Any) -> None:
    """Add the training commands to the `cartridge` command's subparsers."""
    _learn(sub)
    _train(sub)
    _traces(sub)
    _distill(sub)
    _eval(sub)


def _model(p: argparse.ArgumentParser, dtype: str = "float32") -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model path or builtin name (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default=dtype, help=f"model dtype (default {dtype}; auto: bf16 on CUDA, else fp32)")


def _run(p: argparse.ArgumentParser, what: str, dtype: str = "float32") -> None:
    """The flags every training run shares: its seed, device, model, the progress bar and the settings file."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the gradient, the teacher and the samples run: cpu or "
                                                  "cuda[:N]")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _model(p, dtype)
    p.add_argument("--settings", type=Path, metavar="FILE",
                   help=f"YAML of {what} (docs/guides/train-cartridge.md)")


def _learn(sub: Any) -> None:
    p = sub.add_parser("learn", help="a cartridge of a document's facts: fact rows from every sentence, then "
                                     "training (the recipe to use)")
    p.add_argument("--text", required=True, type=Path, help="the document the cartridge will stand for")
    p.add_argument("--tokens", required=True, type=int, help="P: the cartridge's length in tokens")
    p.add_argument("--out", required=True, type=Path, help="the cartridge (+ OUT.facts.jsonl, OUT.ckpt)")
    p.add_argument("--steps", type=int, default=LEARN_STEPS, help=f"optimizer steps (default {LEARN_STEPS})")
    p.add_argument("--teacher-tokens", type=int, metavar="N",
                   help="teach each row from the N-token window of the document around its sentence instead of the "
                        "whole document: for documents longer than the model reads well (256 measured)")
    p.add_argument("--init", choices=INITS, help="the KV's start: the document's own KV cut to P positions, values "
                   "refitted (match, the default), or not refitted (select: for cartridges served together), or its "
                   "first P tokens (prefix, the default with --teacher-tokens)")
    _run(p, f"the recipe's other settings: {', '.join(f.name for f in dataclasses.fields(LearnSettings))}")
    p.set_defaults(cartridge_run="final.training.learn:run")


def _train(sub: Any) -> None:
    t = sub.add_parser("train", help="train a cartridge on rows you have (`traces`' tool-use rows, or your own "
                                     "JSONL): the trainer `learn` runs (resumable)")
    t.add_argument("--data", required=True, type=Path, help="JSONL rows (final/training/rows.py)")
    t.add_argument("--tokens", required=True, type=int, help="P: the cartridge's length in tokens")
    t.add_argument("--out", required=True, type=Path, help="output .pt (cartridges-repo layout) or .safetensors")
    t.add_argument("--text", type=Path, help="a document whose first P tokens start the KV (default: the first "
                                             "row's first P tokens)")
    t.add_argument("--steps", type=int, default=TrainConfig.steps)
    _run(t, "the trainer's other settings: batch, lr, frozen_tokens, checkpoint_every", dtype="auto")
    t.set_defaults(cartridge_run="final.training.run:train")


def _traces(sub: Any) -> None:
    r = sub.add_parser("traces", help="tool-use rows: GSM8K problems played through the multi-turn path with the "
                                      "real tools (hard targets for `train`)")
    r.add_argument("--gsm8k", required=True, type=Path, help="GSM8K JSONL (question, answer ending '#### N')")
    r.add_argument("--tools", required=True, type=Path, help="tools.yaml with the calc_gsm8k_reward tool")
    r.add_argument("--out", required=True, type=Path, help="JSONL to write (must not exist)")
    r.add_argument("--skip", type=int, default=0, help="leave out the first N problems (e.g. those you evaluate on)")
    r.add_argument("--count", type=int, help="problems to use after --skip (default: all)")
    r.add_argument("--config", help="InferenceEngine config whose rollout (chat template, multi_turn) the traces "
                                    "follow (default: the package's)")
    r.add_argument("--model", default=None, help="override model_path")
    r.add_argument("--student", type=Path, help="a tool-use cartridge: rows from what the model writes behind it "
                                                "(its reasoning as context, the call and answer as targets)")
    r.add_argument("--student-tokens", type=int, default=256, help="the student's first-turn limit (default 256)")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(cartridge_run="final.training.run:traces")


def _distill(sub: Any) -> None:
    d = sub.add_parser("distill", help="on-policy distillation: the student samples with the current cartridge "
                                       "(in-process, or veRL through final serve), final is the teacher (resumable)")
    d.add_argument("--text", required=True, type=Path, help="the document the cartridge will stand for")
    d.add_argument("--tokens", required=True, type=int, help="P: the cartridge's length in tokens")
    d.add_argument("--out", required=True, type=Path, help="the cartridge, rewritten after every step (+ OUT.ckpt)")
    d.add_argument("--steps", type=int, default=DistillConfig.steps)
    d.add_argument("--rollout", choices=ROLLOUTS, default="engine",
                   help="engine: sample in-process; verl: veRL's AgentLoopManager through the tokasaurus replica "
                        "against `final serve` (started here unless --server)")
    d.add_argument("--server", help="with --rollout verl: a running `final serve` URL that can read --out")
    d.add_argument("--config", help="InferenceEngine config for the teacher and in-process samples (any backend)")
    _run(d, "the loop's other settings: questions, n, temperature, answer_tokens, lr, init, validate, synth: ...")
    d.set_defaults(cartridge_run="final.training.run:distill")


def _eval(sub: Any) -> None:
    e = sub.add_parser("eval", help="a cartridge's answers to a question set against no document, the document's "
                                    "first p and 8p tokens and the whole document (or two cartridges composed)")
    e.add_argument("path", type=Path)
    e.add_argument("--qa", required=True, type=Path,
                   help="question set (data/qa/NAME.jsonl, its document NAME.txt beside it): multiple-choice "
                        "acc/acc_norm, open answers, KL to the document, with 95%% intervals")
    e.add_argument("--text", type=Path, help="the document the cartridge stands for (default: the --qa set's)")
    e.add_argument("--split", choices=("tune", "test", "all"), default="tune",
                   help="which half of the --qa set to ask (default tune; test is for the final figures only)")
    e.add_argument("--compose", type=Path, metavar="CART_B", help="a second document's cartridge: both served "
                   "together, each alone, each document and both in context (needs --compose-qa)")
    e.add_argument("--compose-qa", type=Path, metavar="QA_B", help="the --compose cartridge's question set")
    e.add_argument("--chunk-tokens", type=int, metavar="N",
                   help="add the relevant-chunk row: each question after the N-token window of the document "
                        "around its support passage alone")
    e.add_argument("--positions", choices=("after_prefix", "from_zero"),
                   help="the cartridges' position convention (default: their manifests')")
    e.add_argument("--json", action="store_true", help="print JSON")
    _model(e)
    e.set_defaults(cartridge_run="final.training.evaluate.report:run")
