"""End to end: self-study synthesis -> distillation for p in {64, 256} -> KL table on held-out questions.

    nice -n 5 .venv/bin/python bench/cartridge_train.py [--work bench/out/cartridge_train] [--steps 24]

Every stage is a `final cartridge` command (what a user runs), timed; each one resumes, so a rerun after a kill
continues where it stopped (finished stages are skipped). Prints the tables and writes `summary.json` in --work.
The document is bench/data/vellmark.txt (original text written for this benchmark, ~1,500 tokens).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "bench" / "data" / "vellmark.txt"


def final(*args: str) -> float:
    """Run `final cartridge ...` and return its wall time."""
    t = time.time()
    subprocess.run([sys.executable, "-m", "final.cli", "cartridge", *args], cwd=ROOT, check=True)
    return time.time() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "out" / "cartridge_train")
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--train-count", type=int, default=48)
    ap.add_argument("--heldout-count", type=int, default=12)
    ap.add_argument("--question-tokens", type=int, default=40)
    ap.add_argument("--answer-tokens", type=int, default=40)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256])
    args = ap.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    common = ["--model", args.model, "--text", str(DOC)]
    synth = ["--chunk-tokens", "2048", "--batch", "16", "--question-tokens", str(args.question_tokens),
             "--answer-tokens", str(args.answer_tokens)]
    times["synth_train"] = final("synth", *common, *synth, "--count", str(args.train_count), "--seed", "0",
                                 "--out", str(work / "train.jsonl"))
    times["synth_heldout"] = final("synth", *common, *synth, "--count", str(args.heldout_count), "--seed", "1",
                                   "--out", str(work / "heldout.jsonl"))
    results = {}
    for p in args.tokens:
        out = work / f"vellmark-p{p}.pt"
        times[f"train_p{p}"] = final("train", *common, "--data", str(work / "train.jsonl"), "--tokens", str(p),
                                     "--steps", str(args.steps), "--batch", str(args.batch), "--out", str(out),
                                     "--quiet")
        t = time.time()
        proc = subprocess.run([sys.executable, "-m", "final.cli", "cartridge", "eval", str(out), *common,
                               "--data", str(work / "heldout.jsonl"), "--json"], cwd=ROOT, check=True,
                              stdout=subprocess.PIPE, text=True)
        times[f"eval_p{p}"] = time.time() - t
        results[p] = json.loads(proc.stdout)
    summary = {"machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"),
               "args": {k: str(v) for k, v in vars(args).items()}, "seconds": times, "results": results}
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    for p, res in results.items():
        print(f"\np = {p}: {res['conversations']} held-out conversations, {res['answer_tokens']} answer tokens")
        print("| condition | prefix tokens | KL to teacher (nats/token) | top-1 agreement | KV bytes |")
        print("|---|---:|---:|---:|---:|")
        for r in res["rows"]:
            print(f"| {r['condition']} | {r['prefix_tokens']} | {r['kl']:.4f} | {r['top1']:.3f} | {r['kv_bytes']:,} |")
    print(cost_table(times, args))
    return 0


def cost_table(times: dict[str, float], args: argparse.Namespace) -> str:
    """The per-stage cost table bench/RESULTS.md shows, as measured by this run (a resumed stage that had
    nothing left to do shows its short time, not the original one)."""
    what = {"synth_train": f"{args.train_count} conversations", "synth_heldout": f"{args.heldout_count} conversations"}
    for p in args.tokens:
        what[f"train_p{p}"] = f"{args.steps} steps x {args.batch} conversations"
        what[f"eval_p{p}"] = f"{args.heldout_count} conversations x 3 forwards, 1 prefill of the document"
    lines = ["\n| stage | what | wall time |", "|---|---|---:|"]
    lines += [f"| {stage} | {what.get(stage, '')} | {sec / 60:.1f} min |" for stage, sec in times.items()]
    lines.append(f"| total | | {sum(times.values()) / 60:.1f} min |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
