"""`final bench`: P1-P4 and the roofline note, ours beside the reference in one run (also `python -m final.bench`).

  final bench                 full run on SmolLM2-135M (about 10 minutes on a quiet 2-core CPU)
  final bench --quick --json  smoke run on the tiny model; one JSON object {"p1", "p2", "p3", "p4", ...}
  final bench --only p1,p4    a subset
  final bench --only dp       one engine vs 2 replicas on Ray (final.pool); not in the default run
  final bench --only soak     final serve under 4,000 mixed requests (issue 13); not in the default run
  final bench --only multiturn  8-turn tool-loop conversations (batch 1 and 8) and n = 8 samples of a 1k prompt:
                              ours with the prefix cache, without it, HF generate and llama.cpp; not in the default run
  final bench --only peer     ours vs llama.cpp on the same weights (needs the `bench` extra; skipped, saying how to
                              install it, when llama_cpp is not importable); --peer-int8 adds int8 vs llama.cpp Q8_0,
                              --peer-bf16 our bf16 weights vs its BF16
Figures are medians of interleaved repeats; the goals are the issue's and are printed, never asserted.
Each measurement runs in its own process (final.bench.isolate; --in-process: this one), so a peer that crashes
(llama.cpp's SIGILL on a CPU its build does not fit, an abort in HF's kernels) is reported and the others run.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from final.bench.isolate import isolated
from final.bench.dp import describe as describe_dp, run_dp
from final.bench.memory import describe, run_memory
from final.bench.multiturn import describe as describe_multiturn, run_multiturn
from final.bench.overhead import run_overhead
from final.bench.peer import describe as describe_peer, run_peer
from final.bench.soak import describe as describe_soak, run_soak
from final.bench.throughput import roofline, run_throughput
from final.bench.timing import machine
from final.bench.ttft import run_ttft
from final.models import DEFAULT_MODEL, resolve_model_path

QUICK_MODEL = "builtin:tiny-random-llama"
GOALS = {"p1": 2.0, "p2": 20.0, "p2_spread": 1.5, "p3": 1.1, "p4_ms": 1.0}


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `bench` command to an argparse subparsers object."""
    p = subparsers.add_parser("bench", help="benchmark the embedded engine against HF generate (P1-P4)")
    p.add_argument("--quick", action="store_true", help="tiny model, small sizes: a smoke run in seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--only", default="p1,p2,p3,p4,peer",
                   help="comma-separated subset of p1,p2,p3,p4,peer,dp,soak,multiturn (dp starts Ray; soak runs final "
                        "serve on the tiny model unless --model)")
    p.add_argument("--model", help=f"model for P1-P3 (default {DEFAULT_MODEL}; --quick: {QUICK_MODEL})")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--repeats", type=int, help="timed repeats per figure (default 3; --quick 1)")
    p.add_argument("--dtypes", default="fp32,bf16", help="P1 dtypes (fp32, bf16)")
    p.add_argument("--batches", help="P1 batch sizes (default 8,32; --quick 2,4)")
    p.add_argument("--new-tokens", type=int, help="P1 new tokens per row (default 64; --quick 8)")
    p.add_argument("--ttft-lengths", help="P2 cartridge lengths (default 512,1024,2048,4096,7168)")
    p.add_argument("--ttft-dtype", default="auto", help="P2/P3 engine dtype (default auto: fp32 on CPU)")
    p.add_argument("--p4-prompts", type=int, help="P4 prompts (default 256; --quick 16)")
    p.add_argument("--dp-replicas", type=int, default=2, help="DP: replicas in the pool (default 2)")
    p.add_argument("--dp-prompts", type=int, help="DP: prompts, greedy, new tokens = --new-tokens (default 64; --quick 8)")
    p.add_argument("--peer-batches", help="peer: batch sizes (default 1,8; --quick 1,2)")
    p.add_argument("--peer-int8", action="store_true", help="peer: also our int8 mode vs llama.cpp's Q8_0")
    p.add_argument("--peer-bf16", action="store_true", help="peer: also our bf16 weights vs llama.cpp's BF16")
    p.add_argument("--soak-requests", type=int, help="soak: requests (default 4000; --quick 200)")
    p.add_argument("--soak-seconds", type=float, default=1200.0, help="soak: stop sending after this long (default 1200)")
    p.add_argument("--soak-concurrency", type=int, default=8, help="soak: concurrent clients (default 8)")
    p.add_argument("--in-process", action="store_true",
                   help="run every measurement in this process (a crash then ends the run; default: one process each)")
    p.add_argument("--mt-batches", help="multiturn: conversations side by side (default 1,8; --quick 1,2)")
    p.add_argument("--mt-turns", type=int, help="multiturn: turns a conversation (default 8; --quick 3)")
    p.add_argument("--mt-new", type=int, help="multiturn: new tokens a turn adds (default 100; --quick 24)")
    p.add_argument("--mt-generated", type=int, help="multiturn: tokens generated a turn (default 48; --quick 6)")
    p.add_argument("--mt-sample-prompt", type=int, help="multiturn: the n-samples prompt's tokens (default 1024; "
                                                         "--quick 128)")
    p.set_defaults(func=_main, argv=[])
    return p


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def run(args: argparse.Namespace) -> dict:
    """Run the selected measurements and return the result object (what --json prints)."""
    import torch

    only = {x.strip().lower() for x in args.only.split(",")}
    repeats = args.repeats or (1 if args.quick else 3)
    name = args.model or (QUICK_MODEL if args.quick else DEFAULT_MODEL)
    model = resolve_model_path(name)
    torch.manual_seed(0)
    out: dict[str, Any] = {"machine": machine(args.device), "command": " ".join(["final bench", *args.argv]),
                           "model": name}
    options = {k: v for k, v in vars(args).items() if k != "func"}
    for key, target in MEASUREMENTS.items():
        if key in only:
            kwargs = {"target": target, "args": options, "model": model, "repeats": repeats}
            result = section(**kwargs) if args.in_process else isolated("final.bench.cli:section", kwargs)
            out.update(result if not ({"crashed", "failed"} & set(result)) else {key: result})
    return out


def section(target: str, args: dict, model: str, repeats: int) -> dict:
    """One measurement (`module:function` of MEASUREMENTS) with the run's options: its part of the result."""
    import importlib

    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(argparse.Namespace(**args), model, repeats)


def _p1(args: argparse.Namespace, model: str, repeats: int) -> dict:
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    batches = _ints(args.batches) if args.batches else ([2, 4] if args.quick else [8, 32])
    new_tokens = args.new_tokens or (8 if args.quick else 64)
    p1 = run_throughput(model, dtypes, batches, new_tokens, repeats, args.device)
    rows = p1.pop("_rows")
    head = next((r for r in rows if r.dtype == "fp32" and r.batch == min(batches)), rows[0])
    # the goal is per batch size (batch 8), not per dtype: report it for each dtype measured
    by_dtype = {r.dtype: round(r.ratio, 3) for r in rows if r.batch == min(batches)}
    return {"p1": {"ours": round(head.ours_tok_s, 2), "reference": round(head.reference_tok_s, 2),
                   "ratio": round(head.ratio, 3), "unit": "tok/s", "headline": f"{head.dtype} batch {head.batch}",
                   "goal": GOALS["p1"], "met": head.ratio >= GOALS["p1"], "rows": p1["rows"],
                   "goal_batch": min(batches), "ratio_by_dtype": by_dtype,
                   "met_by_dtype": {d: r >= GOALS["p1"] for d, r in by_dtype.items()}},
            "roofline": roofline(p1["decode_steps"], args.device)}


def _p2(args: argparse.Namespace, model: str, repeats: int) -> dict:
    lengths = _ints(args.ttft_lengths) if args.ttft_lengths else ([64, 128, 256] if args.quick
                                                                  else [512, 1024, 2048, 4096, 7168])
    p2 = run_ttft(model, lengths, repeats, args.ttft_dtype, args.device)
    rows = p2["rows"]
    head = next((r for r in rows if r["p"] == 2048), rows[len(rows) // 2] if rows else None)
    spread = p2["cartridge_ttft_spread"]
    return {"p2": {"ours": head and head["ours_ms"], "reference": head and head["reference_ms"],
                   "ratio": head and head["ratio"], "unit": "ms TTFT", "headline": head and f"p={head['p']}",
                   "goal": GOALS["p2"], "met": bool(head) and head["ratio"] >= GOALS["p2"],
                   "spread": spread, "spread_goal": GOALS["p2_spread"],
                   "spread_met": spread is not None and spread <= GOALS["p2_spread"],
                   "question_tokens": p2["question_tokens"], "rows": rows}}


def _p3(args: argparse.Namespace, model: str, repeats: int) -> dict:
    p3 = run_memory(model, 256 if args.quick else 2048, 4 if args.quick else 32, 16, args.ttft_dtype, args.device)
    return {"p3": {"ours": p3["all_rows"]["cartridge_bytes_held"], "reference": p3["cartridge_bytes"],
                   "ratio": p3["ratio"], "unit": "bytes", "goal": GOALS["p3"], "met": p3["ratio"] <= GOALS["p3"],
                   **{k: v for k, v in p3.items() if k not in ("ratio",)}}}


def _p4(args: argparse.Namespace, model: str, repeats: int) -> dict:
    # The wrapper's cost is what is measured, so the model is the tiny one and generations are short.
    # A call lasts a fraction of a second, so more repeats are cheap and steady the small difference.
    p4 = run_overhead(QUICK_MODEL, args.p4_prompts or (16 if args.quick else 256), 2, 2 * repeats + 1)
    return {"p4": {**p4, "ours": p4["ours_s"], "reference": p4["reference_s"], "unit": "s per call",
                   "goal_ms_per_prompt": GOALS["p4_ms"], "met": p4["ms_per_prompt"] <= GOALS["p4_ms"]}}


def _peer(args: argparse.Namespace, model: str, repeats: int) -> dict:
    name = args.model or (QUICK_MODEL if args.quick else DEFAULT_MODEL)
    batches = _ints(args.peer_batches) if args.peer_batches else ([1, 2] if args.quick else [1, 8])
    return run_peer(name, model, batches, args.new_tokens or (8 if args.quick else 64), repeats, args.device,
                    int8=args.peer_int8, bf16=args.peer_bf16)


def _dp(args: argparse.Namespace, model: str, repeats: int) -> dict:
    return {"dp": run_dp(model, args.dp_prompts or (8 if args.quick else 64), args.new_tokens or (8 if args.quick
                         else 64), repeats, args.dp_replicas, args.device)}


def _soak(args: argparse.Namespace, model: str, repeats: int) -> dict:
    # robustness, not speed: the tiny model keeps 4,000 requests to minutes on a CPU
    soak_model = args.model or QUICK_MODEL
    soak = run_soak(soak_model, args.soak_requests or (200 if args.quick else 4000), args.soak_seconds,
                    args.soak_concurrency)["soak"]
    return {"soak": {"model": soak_model, **soak}}


def _multiturn(args: argparse.Namespace, model: str, repeats: int) -> dict:
    name = args.model or (QUICK_MODEL if args.quick else DEFAULT_MODEL)
    batches = _ints(args.mt_batches) if args.mt_batches else ([1, 2] if args.quick else [1, 8])
    return run_multiturn(name, model, batches, args.mt_turns or (3 if args.quick else 8),
                         args.mt_new or (24 if args.quick else 100), args.mt_generated or (6 if args.quick else 48),
                         repeats, sample_prompt=args.mt_sample_prompt or (128 if args.quick else 1024))


MEASUREMENTS = {key: f"final.bench.cli:_{key}" for key in ("p1", "p2", "p3", "p4", "peer", "dp", "soak",
                                                                 "multiturn")}


def report(res: dict) -> str:
    """The human-readable table."""
    broken = {k: v for k, v in res.items() if isinstance(v, dict) and {"crashed", "failed"} & set(v)}
    lines = _table({k: v for k, v in res.items() if k not in broken})
    for key, v in broken.items():
        lines += ["", f"{key}: {'crashed' if 'crashed' in v else 'failed'}: {v.get('crashed') or v.get('failed')}"]
        lines += [f"  | {line}" for line in (v.get("output") or "").strip().splitlines()[-8:]]
    return "\n".join(lines)


def _table(res: dict) -> list[str]:
    m = res["machine"]
    lines = [f"final bench: {m['date']}, {m['cpu']} ({m['cores']} cores, flags {' '.join(m.get('cpu_flags') or ['?'])}, "
             f"torch {m['torch']}, "
             f"{m['torch_threads']} threads, device {m['device']}{', ' + m['gpu'] if 'gpu' in m else ''}), "
             f"load {m.get('loadavg_1min', '?')}, model {res['model']}"]
    ok = lambda met: "met" if met else "NOT met"  # noqa: E731
    if "p1" in res:
        p = res["p1"]
        goals = ", ".join(f"{d} {ok(m)} ({p['ratio_by_dtype'][d]:.2f}x)" for d, m in p["met_by_dtype"].items())
        lines += ["", f"P1 throughput, greedy, tok/s (goal >= {p['goal']}x at batch {p['goal_batch']}: {goals})",
                  f"  {'dtype':6} {'batch':>5} {'ours':>9} {'HF generate':>12} {'ratio':>7} {'same tokens as HF':>18}"]
        for r in p["rows"]:
            lines.append(f"  {r['dtype']:6} {r['batch']:>5} {r['ours']:>9.1f} {r['reference']:>12.1f} "
                         f"{r['ratio']:>6.2f}x {r['greedy_parity']:>18}")
        rf = res.get("roofline", {})
        if "copy_bandwidth_gb_s" in rf:
            lines.append(f"  roofline: copy bandwidth {rf['copy_bandwidth_gb_s']} GB/s")
            for name, d in rf["dtypes"].items():
                lines.append(f"    {name} batch {d['batch']}: {d['bytes_per_step_mb']} MB read -> "
                             f"{d['memory_floor_ms']} ms; {d['gflop_per_step']} GFLOP at "
                             f"{d['matmul_peak_gflop_s']} GFLOP/s -> "
                             f"{d['compute_floor_ms']} ms; decode step: ours {d['ours_ms']} ms "
                             f"({d['ours_over_floor']}x the floor), HF {d['reference_ms']} ms")
    if "p2" in res:
        p = res["p2"]
        lines += ["", f"P2 TTFT, cartridge vs prefill of the same p tokens, ms (+{p['question_tokens']} question "
                      f"tokens; goal >= {p['goal']}x at {p['headline']}: {ok(p['met'])}; cartridge TTFT spread "
                      f"{p['spread']}x, goal <= {p['spread_goal']}x: {ok(p['spread_met'])})",
                  f"  {'p':>6} {'cartridge':>10} {'prefill':>10} {'ratio':>8}"]
        for r in p["rows"]:
            lines.append(f"  {r['p']:>6} {r['ours_ms']:>10.1f} {r['reference_ms']:>10.1f} {r['ratio']:>7.1f}x")
    if "p3" in res:
        p = res["p3"]
        lines += ["", f"P3 memory (goal <= {p['goal']}x: {ok(p['met'])})", "  " + describe(p)]
    if "p4" in res:
        p = res["p4"]
        lines += ["", f"P4 wrapper overhead (goal <= {p['goal_ms_per_prompt']} ms/prompt: {ok(p['met'])})",
                  f"  {p['prompts']} prompts x {p['new_tokens']} tokens: InferenceEngine.generate "
                  f"{p['ours_s'] * 1e3:.1f} ms, rollout.generate_sequences(prebuilt DataProto) "
                  f"{p['reference_s'] * 1e3:.1f} ms -> "
                  f"{p['ms_per_prompt']:.3f} ms/prompt"]
    return lines + _sections(res)


def _sections(res: dict) -> list[str]:
    """The lines of the sections outside P1-P4 (each module describes its own)."""
    lines: list[str] = []
    if "peer" in res:
        lines += ["", "Peer: llama.cpp on the same weights, greedy, tok/s", *describe_peer(res["peer"])]
    if "dp" in res:
        lines += ["", f"DP data parallelism, greedy, tok/s ({res['dp']['note']})", "  " + describe_dp(res["dp"])]
    if "multiturn" in res:
        lines += ["", "Multi-turn tool loop: prefix cache vs none, HF generate, llama.cpp (wall time, TTFT by turn)",
                  *describe_multiturn(res["multiturn"])]
    if "soak" in res:
        s = res["soak"]
        lines += ["", f"Soak: final serve under mixed load (goals: 0 unexpected statuses, RSS drift < 5%, 0 cartridge "
                      f"references held, alive: {'met' if s['met'] else 'NOT met'})", "  " + describe_soak(s)]
    return lines


def _main(args: argparse.Namespace) -> int:
    if not args.argv and sys.argv[1:2] == ["bench"]:
        args.argv = sys.argv[2:]
    res = run(args)
    print(json.dumps(res) if args.json else report(res))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="final")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(["bench", *argv])
    args.argv = argv
    return args.func(args)
