"""What `final cartridge train`, `traces` and `distill` do with their flags: settings, engine, the method, a line
saying what was written (`learn` is final/training/learn.py, `eval` final/training/evaluate/report.py)."""

from __future__ import annotations

import argparse

from final.config import load_config
from final.errors import ConfigError
from final.inf import InferenceEngine
from final.training.inputs import open_engine, read_settings_file, read_text
from final.training.onpolicy.loop import distill as distill_loop
from final.training.settings import DistillConfig, TrainConfig
from final.training.traces import build_traces
from final.training.train import train_cartridge


def train(args: argparse.Namespace) -> int:
    cfg = read_settings_file(args.settings, TrainConfig, tokens=args.tokens, steps=args.steps, seed=args.seed,
                             beside=0.0, keep=0.0, hidden=0.0)
    summary = train_cartridge(args.model, args.data, args.out, cfg, text=read_text(args.text) if args.text else None,
                              device=args.device, dtype=args.dtype, progress=not args.quiet,
                              source_document=str(args.text) if args.text else None)
    print(f"wrote {summary['out']} ({summary['tokens']} tokens, {summary['bytes']} bytes): loss "
          f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, KL {summary['first_kl']:.4f} -> "
          f"{summary['last_kl']:.4f} over {summary['steps']} steps on {summary['conversations']} conversations")
    return 0


def traces(args: argparse.Namespace) -> int:
    if not args.tools.is_file():
        raise ConfigError("tools file does not exist", key="--tools", path=str(args.tools))
    if args.student and not args.student.is_file():
        raise ConfigError("cartridge file does not exist", key="--student", path=str(args.student))
    model = {"model_path": args.model} if args.model else {}
    config = load_config(args.config, {"rollout": {"multi_turn": {"enable": True,
                                                                   "tool_config_path": str(args.tools)}}, **model})
    student = (InferenceEngine(args.config, **model), str(args.student)) if args.student else None
    try:
        summary = build_traces(config, args.gsm8k, args.out, skip=args.skip, count=args.count,
                               progress=not args.quiet, student=student, student_tokens=args.student_tokens)
    finally:
        if student:
            student[0].shutdown()
    print(f"wrote {summary['rows']} rows ({summary['problems']} problems, {summary['targets']} target tokens of "
          f"{summary['tokens']}) to {summary['out']}")
    return 0


def distill(args: argparse.Namespace) -> int:
    text = read_text(args.text)
    cfg = read_settings_file(args.settings, DistillConfig, tokens=args.tokens, steps=args.steps, seed=args.seed,
                             rollout=args.rollout)
    inference = open_engine(args.model, args.dtype, args.device, args.config)
    try:
        history = distill_loop(inference, text, args.out, cfg, model=args.model, device=args.device,
                               dtype=args.dtype, server=args.server, progress=not args.quiet)
    finally:
        inference.shutdown()
    first, last = history[0], history[-1]
    print(f"wrote {args.out} ({cfg.tokens} tokens): loss {first['loss']:.4f} -> {last['loss']:.4f}, KL "
          f"{first['forward_kl']:.4f} -> {last['forward_kl']:.4f} over {len(history)} steps")
    if "kept_step" in last:
        print(f"validation KL {first.get('start_validation_kl', float('nan')):.4f} at the start; {args.out} holds "
              f"the best judged, after step {last['kept_step']} ({last['kept_validation_kl']:.4f})")
    return 0


