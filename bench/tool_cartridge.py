"""Issue 28: a tool-use cartridge for SmolLM2-135M, end to end, on GSM8K problems it never saw.

    nice -n 5 .venv/bin/python bench/tool_cartridge.py [--tokens 32 64 128] [--steps 100] [--heldout 200]
        [--student 64 --student-count 400 --rounds 2]

The recipe a user runs, each stage a command, timed:
  final cartridge traces --gsm8k DATA --tools tools.yaml --skip H --out traces.jsonl   (problems H.. only)
  final cartridge train --data traces.jsonl --tokens P --out tooluse-pP.pt           (its defaults but --steps)
  final eval gsm8k --data DATA --limit H --tools tools.yaml --cartridge tooluse-pP.pt (the first H problems)
and the baselines without a cartridge (with and without the tool). With --student P, DAgger rounds on top:
  final cartridge traces ... --count C --student tooluse-pP.pt --out student-pP.jsonl (the model's own first turns)
  cat traces.jsonl student-pP.jsonl > mixed-pP.jsonl; final cartridge train --data mixed-pP.jsonl ... (from scratch)
and each further round the same with the last round's cartridge as the student, on the next C problems. Finished
stages are skipped on a rerun (delete --work to start over). Prints the table README and bench/RESULTS.md show, and
writes summary.json in --work. With --verl-path, each cartridge is evaluated a second time through `final eval verl`
on the same problems written as veRL's gsm8k_multiturn_w_tool.py writes them (--tools-in-system, the preset's
lengths), and the two are compared problem by problem (issue 44: both eval commands give one answer).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
TOOLS = ROOT / "tools.yaml"


def run(*args: str) -> float:
    """Run `final ...` and return its wall time."""
    t = time.time()
    subprocess.run([sys.executable, "-m", "final.cli", *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.time() - t


def summary(path: Path) -> dict:
    """The eval's figures, recomputed from its per-problem records (final.evals.gsm8k.summarize)."""
    from final.evals.gsm8k import summarize

    records = [json.loads(line) for line in path.read_text().splitlines()]
    return summarize(records, 0.0, tools=any(r["tool_reward"] is not None for r in records))


def evaluate(work: Path, name: str, args: argparse.Namespace, *extra: str) -> dict:
    out = work / f"eval-{name}.jsonl"
    done = work / f"eval-{name}.seconds"
    if not done.exists():
        seconds = run("eval", "gsm8k", "--data", str(args.data), "--limit", str(args.heldout), "--out", str(out),
                      *extra)
        done.write_text(f"{seconds:.1f}")
    return {**summary(out), "eval_s": float(done.read_text())}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "out" / "tool_cartridge")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--heldout", type=int, default=200, help="the first N problems are evaluated, never trained on")
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--steps", type=int, default=100, help="training steps (train's default: 100)")
    ap.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--student", type=int, help="p of the cartridge whose own turns make student rows (DAgger)")
    ap.add_argument("--student-count", type=int, default=400, help="new problems for each round's student rows")
    ap.add_argument("--rounds", type=int, default=1, help="DAgger rounds (default 1)")
    ap.add_argument("--verl-path", action="store_true", help="also evaluate each cartridge with `final eval verl`")
    args = ap.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    traces = work / "traces.jsonl"
    times: dict[str, float] = {}
    if not traces.exists():
        times["traces"] = run("cartridge", "traces", "--gsm8k", str(args.data), "--tools", str(TOOLS), "--skip",
                              str(args.heldout), "--out", str(traces), "--quiet")
    rows: dict[str, dict] = {}
    if args.baselines:
        rows["no cartridge, no tool"] = evaluate(work, "plain", args)
        rows["no cartridge, tool"] = evaluate(work, "tools", args, "--tools", str(TOOLS))
    for p in args.tokens:
        rows[f"cartridge p={p}, tool"] = trained(work, f"p{p}", p, traces, args)
    if args.student:
        dagger(work, traces, args, rows, times)
    print(table(rows, args))
    for name, r in rows.items():
        if "verl_path" in r:
            v = r["verl_path"]
            print(f"{name}: final eval verl tool-call rate {v['tool_call_rate']:.3f}, accuracy {v['accuracy']:.3f} "
                  f"(final eval gsm8k: {r['tool_call_rate']:.3f}, {r['accuracy']:.3f}); same messages on "
                  f"{v['same_messages']}/{v['problems']} problems, same score on {v['same_score']}/{v['problems']}")
    info = {"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "load": os.getloadavg(), "steps": args.steps, "heldout": args.heldout, "rows": rows, "times": times}
    (work / "summary.json").write_text(json.dumps(info, indent=2))
    return 0


def dagger(work: Path, traces: Path, args: argparse.Namespace, rows: dict, times: dict) -> None:
    """--rounds DAgger rounds from the p=--student cartridge: round r's student (the previous round's cartridge)
    writes the first turns of the next --student-count problems after the held-out ones, and a cartridge is
    trained from scratch on the reference rows plus every round's student rows so far."""
    p, cart, seen = args.student, work / f"tooluse-p{args.student}.pt", [traces]
    for r in range(1, args.rounds + 1):
        tag = "" if r == 1 else str(r)  # round 1 keeps the names of the runs measured before --rounds
        student, mixed = work / f"student{tag}-p{p}.jsonl", work / f"mixed{tag}-p{p}.jsonl"
        seconds = work / f"student{tag}.seconds"
        if not student.exists():
            skip = args.heldout + (r - 1) * args.student_count
            times[f"student_traces_{r}"] = run("cartridge", "traces", "--gsm8k", str(args.data), "--tools",
                                               str(TOOLS), "--skip", str(skip), "--count", str(args.student_count),
                                               "--student", str(cart), "--out", str(student), "--quiet")
            seconds.write_text(f"{times[f'student_traces_{r}']:.1f}")
        seen.append(student)
        if not mixed.exists():
            mixed.write_text("".join(f.read_text() for f in seen))
        row = trained(work, f"p{p}-student{tag}", p, mixed, args)
        row["train_s"] += float(seconds.read_text())  # the round's own cost, not the earlier rounds'
        rows[f"cartridge p={p}, DAgger round {r} (+ student rows of {r * args.student_count} problems), tool"] = row
        cart = work / f"tooluse-p{p}-student{tag}.pt"


def trained(work: Path, name: str, p: int, data: Path, args: argparse.Namespace) -> dict:
    """Train (unless done) a p-token cartridge on `data` at train's defaults but --steps, and evaluate it."""
    cart = work / f"tooluse-{name}.pt"
    if not cart.exists():
        seconds = run("cartridge", "train", "--data", str(data), "--tokens", str(p), "--steps", str(args.steps),
                      "--out", str(cart), "--quiet")
        (work / f"train-{name}.seconds").write_text(f"{seconds:.1f}")
    row = evaluate(work, name, args, "--tools", str(TOOLS), "--cartridge", str(cart))
    row["train_s"] = float((work / f"train-{name}.seconds").read_text())
    if args.verl_path:
        row["verl_path"] = verl_path(work, name, cart, args)
    return row


def verl_path(work: Path, name: str, cart: Path, args: argparse.Namespace) -> dict:
    """`final eval verl` on the held-out problems in veRL's layout, with the cartridge, at the preset's lengths (the
    config's prompt_length/response_length); compared with `final eval gsm8k`'s records of the same problems."""
    from final.evals.verl_data import gsm8k_multiturn_w_tool, write_parquet

    parquet, out = work / "heldout.parquet", work / f"verl-{name}.jsonl"
    if not parquet.exists():
        problems = [json.loads(line) for line in args.data.read_text().splitlines()[:args.heldout]]
        write_parquet(parquet, gsm8k_multiturn_w_tool(problems))
    if not out.exists():
        run("eval", "verl", "--data", str(parquet), "--tools", str(TOOLS), "--tools-in-system", "--cartridge",
            str(cart), "--out", str(out), "data.max_prompt_length=1024", "data.max_response_length=512")
    verl = [json.loads(line) for line in out.read_text().splitlines()]
    preset = [json.loads(line) for line in (work / f"eval-{name}.jsonl").read_text().splitlines()]
    metrics = json.loads(out.with_suffix(".metrics.json").read_text())
    return {"problems": len(verl), "tool_call_rate": sum(1 for r in verl if r["tool_calls"]) / len(verl),
            "accuracy": sum(r["score"] for r in verl) / len(verl),
            "same_messages": sum(a["messages"] == b["messages"] for a, b in zip(preset, verl)),
            "same_score": sum(a["score"] == b["score"] for a, b in zip(preset, verl)),
            "metrics": metrics.get("metrics", metrics)}


def table(rows: dict[str, dict], args: argparse.Namespace) -> str:
    head = ("| SmolLM2-135M-Instruct, first {} GSM8K test problems | tool-call rate | well-formed call rate | mean "
            "assistant turns | accuracy (strict) | accuracy (flexible) | train s ({} steps) | eval s |".format(
                args.heldout, args.steps))
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        train = f"{r['train_s']:.0f}" if "train_s" in r else "-"
        lines.append(f"| {name} | {r['tool_call_rate']:.3f} | {r['well_formed_call_rate']:.3f} | "
                     f"{r['mean_turns']:.2f} | {r['accuracy']:.3f} | {r['flexible_accuracy']:.3f} | {train} | "
                     f"{r['eval_s']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
