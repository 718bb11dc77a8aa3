"""`final cartridge synth | train | distill | traces`: the flags and handlers of the training commands (the
`cartridge` command itself, with build/inspect/verify/convert, is final/distill/cli.py; `eval` is eval_cli.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "builtin:smollm2-135m-instruct"


def open_engine(args: argparse.Namespace, device: str = "cpu"):
    """The embedded engine (through InferenceEngine, the one composition root) and its tokenizer; on `device` where
    a command's --device also puts its teacher and samples there (learn, distill), else on the CPU."""
    from final.inf import local_engine

    inference = local_engine(args.model, dtype=args.dtype, device=device)
    return inference, inference.engine, inference.tokenizer


def read_text(path: Path) -> str:
    from final.training.rows import read_utf8
    from final.errors import CartridgeError

    if not path.is_file():
        raise CartridgeError("text file does not exist", file=str(path), field="text")
    return read_utf8(path, "text")


def chunk_range(value: str) -> tuple[int, int]:
    """--chunk-tokens MIN-MAX (or one number for both)."""
    lo, _, hi = value.partition("-")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN-MAX or N, got {value!r}") from None


def _model_args(p: argparse.ArgumentParser, dtype: str = "float32") -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model path or builtin name (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default=dtype, help=f"model dtype (default {dtype}; auto: bf16 on CUDA, else fp32)")


def _question_args(p: argparse.ArgumentParser, chunk: str, question_tokens: int) -> None:
    p.add_argument("--chunk-tokens", type=chunk_range, default=chunk_range(chunk),
                   help=f"each chunk's length, drawn in MIN-MAX (default {chunk}; the repo: 512-4096)")
    p.add_argument("--question-tokens", type=int, default=question_tokens)
    p.add_argument("--cot-probability", type=float, default=0.2,
                   help="share of questions given a chain-of-thought instruction (default 0.2, the repo's)")
    p.add_argument("--plain-system", action="store_true",
                   help="the chunk alone in the system turn, not in the repo's system-prompt template")
    p.add_argument("--top-k", type=int, default=20, help="teacher logprobs kept per target token (default 20)")
    p.add_argument("--seed-types", type=lambda v: tuple(x.strip() for x in v.split(",") if x.strip()),
                   help="self-study seed prompts to draw from, comma-separated (default: all of structuring, "
                        "summarization, question, use_case, creative; e.g. question for fact questions only)")
    p.add_argument("--supervise", choices=("all", "answer"), default="all",
                   help="targets: every token after the system turn (default, the repo's) or the answer's only")


def register_training(sub: Any) -> None:
    s = sub.add_parser("synth", help="self-study: synthesize conversations about a document (resumable JSONL)")
    s.add_argument("--text", required=True, type=Path, help="document text file")
    s.add_argument("--out", required=True, type=Path, help="JSONL to append to (rows already there are kept)")
    s.add_argument("--config", help="InferenceEngine config (any backend); default: the local engine on --model")
    s.add_argument("--count", type=int, default=64, help="conversations in the file when done (default 64)")
    s.add_argument("--batch", type=int, default=16, help="conversations per chunk (default 16)")
    _question_args(s, "512-2048", 128)
    s.add_argument("--answer-tokens", type=int, default=256)
    s.add_argument("--temperature", type=float, default=0.6, help="question sampling temperature (default 0.6)")
    s.add_argument("--answer-temperature", type=float, default=0.0, help="teacher temperature (default 0)")
    s.add_argument("--seed", type=int, default=0, help="chunks, seed prompts and sampling (another seed: held-out)")
    _model_args(s)
    s.set_defaults(cartridge_func=_synth)

    t = sub.add_parser("train", help="distil synthesized conversations into a trained cartridge (resumable)")
    t.add_argument("--data", required=True, type=Path,
                   help="JSONL from `final cartridge synth` (teacher top-k) or `traces` (hard targets)")
    t.add_argument("--text", type=Path, help="the document (its first P tokens initialise the KV; default: the "
                                             "first conversation's first P tokens)")
    t.add_argument("--init-text", type=Path, help="initialise from this (unrelated) text's first P tokens instead")
    t.add_argument("--tokens", required=True, type=int, help="P: the cartridge's length in tokens")
    t.add_argument("--out", required=True, type=Path, help="output .pt (cartridges-repo layout) or .safetensors")
    t.add_argument("--steps", type=int, default=100)
    t.add_argument("--batch", type=int, default=4, help="conversations per step (default 4)")
    t.add_argument("--lr", type=float, default=2e-2)
    t.add_argument("--frozen-tokens", type=int, default=1, help="leading tokens kept fixed (default 1, the sink)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (OUT.ckpt)")
    t.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    t.add_argument("--save-dtype", help="dtype of the saved tensors (default: the model's)")
    t.add_argument("--id", help="cartridge id recorded in the manifest (default: the output file's stem)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    _model_args(t, "auto")
    t.set_defaults(cartridge_func=_train)
    _register_distill(sub)
    _register_traces(sub)
    from final.training.evaluate.command import register_eval

    register_eval(sub)


def _register_distill(sub: Any) -> None:
    d = sub.add_parser("distill", help="on-policy distillation: the student samples with the current cartridge, "
                                       "final (the document as a cartridge) is the teacher (resumable)")
    d.add_argument("--text", required=True, type=Path, help="the document the cartridge will stand for")
    d.add_argument("--tokens", required=True, type=int, help="P: the cartridge's length in tokens")
    d.add_argument("--out", required=True, type=Path, help="the cartridge, rewritten after every step (+ OUT.ckpt)")
    d.add_argument("--steps", type=int, default=40)
    d.add_argument("--questions", type=int, default=8, help="questions per step (default 8)")
    d.add_argument("--n", type=int, default=1, help="student samples per question (default 1)")
    d.add_argument("--temperature", type=float, default=1.0, help="the student's sampling temperature")
    d.add_argument("--answer-tokens", type=int, default=128)
    d.add_argument("--loss", help="on the student's own tokens: forward_topk, forward_topk_tail, reverse_k1 or "
                                  "reverse_k3 (default: DistillConfig's; see docs/guides/train-cartridge.md)")
    d.add_argument("--on-policy-fraction", type=float, default=1.0,
                   help="share of each step's questions the student answers; the rest the teacher (off-policy)")
    d.add_argument("--lr", type=float,
                   help="Adam's learning rate (default: DistillConfig's, measured: docs/guides/train-cartridge.md)")
    d.add_argument("--schedule", help="the lr over --steps: cosine (DistillConfig's default) decays it to 0 at the "
                                      "last step, constant keeps it")
    d.add_argument("--updates", type=int, default=1, help="Adam steps on each step's rows (default 1)")
    d.add_argument("--init", help="the cartridge's start: prefix (the document's first P tokens), select (each "
                                  "KV head's P most attended positions of the whole document) or match (select's "
                                  "positions, values fitted to the teacher's attention; default: DistillConfig's)")
    d.add_argument("--init-questions", type=int,
                   help="select/match: how many teacher-answered self-study conversations' attention picks the "
                        "positions (default: DistillConfig's)")
    d.add_argument("--validate", type=int,
                   help="teacher-answered conversations, never trained on, that judge the cartridge at each "
                        "checkpoint; OUT ends as the best judged, the start included (0: the last step's; "
                        "default: DistillConfig's)")
    d.add_argument("--frozen-tokens", type=int, default=1)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--checkpoint-every", type=int, default=5)
    d.add_argument("--rollout", choices=("engine", "verl"), default="engine",
                   help="engine: sample in-process; verl: veRL's AgentLoopManager through the tokasaurus replica "
                        "against `final serve` (started here unless --server)")
    d.add_argument("--server", help="with --rollout verl: a running `final serve` URL that can read --out")
    d.add_argument("--config", help="InferenceEngine config for the teacher and in-process rollouts (any backend)")
    d.add_argument("--device", default="cpu",
                   help="where the gradient, the teacher and the in-process samples run: cpu or cuda[:N]")
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    _question_args(d, "512-2048", 64)
    _model_args(d)
    d.set_defaults(cartridge_func=_distill)


def _register_traces(sub: Any) -> None:
    r = sub.add_parser("traces", help="tool-use conversations: GSM8K problems played through the multi-turn path "
                                      "with the real tools (hard targets for `train`)")
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
    r.set_defaults(cartridge_func=_traces)


def _traces(args: argparse.Namespace) -> int:
    from final.config import load_config
    from final.training.traces import build_traces
    from final.errors import ConfigError

    if not args.tools.is_file():
        raise ConfigError("tools file does not exist", key="--tools", path=str(args.tools))
    overrides: dict[str, Any] = {"rollout": {"multi_turn": {"enable": True, "tool_config_path": str(args.tools)}}}
    model = {"model_path": args.model} if args.model else {}
    config = load_config(args.config, {**overrides, **model})
    student = None
    if args.student:
        from final.inf import InferenceEngine

        if not args.student.is_file():
            raise ConfigError("cartridge file does not exist", key="--student", path=str(args.student))
        student = (InferenceEngine(args.config, **model), str(args.student))
    try:
        summary = build_traces(config, args.gsm8k, args.out, skip=args.skip, count=args.count,
                               progress=not args.quiet, student=student, student_tokens=args.student_tokens)
    finally:
        if student:
            student[0].shutdown()
    print(f"wrote {summary['rows']} rows ({summary['problems']} problems, {summary['targets']} target tokens of "
          f"{summary['tokens']}) to {summary['out']}")
    return 0


def _synth_config(args: argparse.Namespace, **kw: Any):
    from final.training.onpolicy.selfstudy import SynthConfig

    return SynthConfig(min_chunk_tokens=args.chunk_tokens[0], max_chunk_tokens=args.chunk_tokens[1],
                       question_tokens=args.question_tokens, top_k=args.top_k, cot_probability=args.cot_probability,
                       supervise=args.supervise, template=None if args.plain_system else SynthConfig.template,
                       **({"seed_types": args.seed_types} if args.seed_types else {}), **kw)


def _inference(args: argparse.Namespace, device: str = "cpu"):
    """The teacher's and samples' engine: the --config's, else the embedded one on `device` (distill's --device;
    synth has none, and writes its rows on the CPU)."""
    if args.config:
        from final.inf import InferenceEngine

        return InferenceEngine(args.config)
    return open_engine(args, device=device)[0]


def _synth(args: argparse.Namespace) -> int:
    from final.training.onpolicy.selfstudy import synthesize

    text = read_text(args.text)
    cfg = _synth_config(args, count=args.count, batch=args.batch, answer_tokens=args.answer_tokens,
                        question_temperature=args.temperature, answer_temperature=args.answer_temperature,
                        seed=args.seed)
    cfg.check()
    inference = _inference(args)
    try:
        written = synthesize(inference, text, args.out, cfg)
    finally:
        inference.shutdown()
    print(f"wrote {written} conversations to {args.out} ({cfg.count} in all)")
    return 0


def _train(args: argparse.Namespace) -> int:
    import torch

    from final.training.train import TrainConfig, train_cartridge
    from final.engine.engine import resolve_dtype

    cfg = TrainConfig(tokens=args.tokens, steps=args.steps, batch=args.batch, lr=args.lr,
                      frozen_tokens=args.frozen_tokens, seed=args.seed, checkpoint_every=args.checkpoint_every)
    save = resolve_dtype(args.save_dtype, torch.device("cpu")) if args.save_dtype else None
    summary = train_cartridge(args.model, args.data, args.out, cfg,
                              text=read_text(args.text) if args.text else None,
                              init_text=read_text(args.init_text) if args.init_text else None,
                              device=args.device, dtype=args.dtype, save_dtype=save, cartridge_id=args.id,
                              source_document=str(args.text) if args.text else None, progress=not args.quiet)
    print(f"wrote {summary['out']} ({summary['tokens']} tokens, {summary['bytes']} bytes): loss "
          f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, KL {summary['first_kl']:.4f} -> "
          f"{summary['last_kl']:.4f} over {summary['steps']} steps on {summary['conversations']} conversations")
    return 0


def _distill(args: argparse.Namespace) -> int:
    from final.training.onpolicy.loop import DistillConfig, distill

    text = read_text(args.text)
    given = {k: getattr(args, k) for k in ("lr", "schedule", "init", "init_questions", "validate", "loss")
             if getattr(args, k) is not None}
    cfg = DistillConfig(**given,  # a flag left out keeps DistillConfig's default (one place for them)
                        tokens=args.tokens, steps=args.steps, questions=args.questions, n=args.n,
                        temperature=args.temperature, answer_tokens=args.answer_tokens, top_k=args.top_k,
                        updates=args.updates, on_policy_fraction=args.on_policy_fraction,
                        supervise=args.supervise, frozen_tokens=args.frozen_tokens, seed=args.seed,
                        checkpoint_every=args.checkpoint_every, rollout=args.rollout,
                        synth=_synth_config(args, seed=args.seed))
    cfg.check()
    inference = _inference(args, device=args.device)
    try:
        history = distill(inference, text, args.out, cfg, model=args.model, device=args.device, dtype=args.dtype,
                          server=args.server, progress=not args.quiet)
    finally:
        inference.shutdown()
    first, last = history[0], history[-1]
    print(f"wrote {args.out} ({cfg.tokens} tokens): loss {first['loss']:.4f} -> {last['loss']:.4f}, KL "
          f"{first['forward_kl']:.4f} -> {last['forward_kl']:.4f} over {len(history)} steps")
    if "kept_step" in last:
        print(f"validation KL {first.get('start_validation_kl', float('nan')):.4f} at the start; {args.out} holds "
              f"the best judged, after step {last['kept_step']} ({last['kept_validation_kl']:.4f})")
    return 0
