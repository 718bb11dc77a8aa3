"""Profile the embedded engine's decode step (the evidence behind the changes recorded in bench/RESULTS.md).

    python bench/profile_decode.py --dtype float32 --batch 8              # ms per decode step
    python bench/profile_decode.py --dtype bfloat16 --batch 32 --profile  # + torch.profiler table by op/shape
    python bench/profile_decode.py --no-gemm                              # the step without its matmuls
    python bench/profile_decode.py --batch 1 --quantization int8 --isas avx2,avx512bf16 --roofline
                                                  # the kernel's builds side by side (one engine each, alternating)
    python bench/profile_decode.py --batch 1 --quantization int8 --cflags "|-DPFHINT=_MM_HINT_T0|-DNO_STEAL"
                                                  # the same for gcc flags (gemv.c's #ifndef knobs) on one build
    python bench/profile_decode.py --batch 1 --quantization int8 --phases
                                                  # where the kernel's decode layers spend the step, per thread
    python bench/profile_decode.py --batch 1 --prefill 113 --cached 1231   # a conversation turn's prefill

Times are the engine thread's CPU time (time.thread_time), which other processes on a shared machine
disturb far less than wall time; `--threads 1` makes them comparable across runs. `--no-gemm` swaps every
weight matmul for a preallocated result, leaving what the step spends outside the GEMMs (Python, small ops,
attention, sampling).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def streamed_bytes(model) -> int:
    """The weight bytes a decode step reads: every matrix once (int8: its int8 values and their scales; bf16: 2 bytes
    a weight), the tied
    embedding as the lm_head; norms are noise."""
    linears = [model.lm_head] + [lin for layer in model.layers for lin in (layer.wqkv, layer.wo, layer.w_gate_up,
                                                                           layer.w_down)]
    return sum(lin._gemv_weight().nbytes + (lin._gemv_scale().nbytes if lin._gemv_scale() is not None else 0)
               if lin.gemv is not None else lin.nbytes for lin in linears)


def kv_bytes(cache, seqs) -> int:
    """The K/V cache bytes a decode step of these rows reads: every layer's keys and values over each row's context
    (its cartridge, its cached tokens and the one the step adds). The weights' stream has flushed them from every
    cache since the step before, so they come from memory as the weights do (2-3% of an int8 step's bytes at the
    30-130 tokens these runs decode over)."""
    return cache.bytes_per_token * sum(s.prefix_len + s.cached_len + 1 for s in seqs)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's table grouped by input shape")
    ap.add_argument("--no-gemm", action="store_true",
                    help="replace weight matmuls by preallocated outputs (on torch's path: FINAL_GEMV=0)")
    ap.add_argument("--quantization", default=None, help="int8 or bf16: the engine's weight-only modes")
    ap.add_argument("--roofline", action="store_true", help="also the GB/s the step streams vs the machine's")
    ap.add_argument("--isas", default=None,
                    help="comma-separated kernel builds (final.engine.kernels.ISAS) to time side by side")
    ap.add_argument("--cflags", default=None,
                    help="'|'-separated extra gcc flags (FINAL_GEMV_CFLAGS), each a build of the --isas one (default: "
                         "the best this CPU runs), timed side by side; '' is the build as shipped")
    ap.add_argument("--rounds", type=int, default=12, help="--isas/--cflags: rounds, each every build in turn")
    ap.add_argument("--other-team", action="store_true",
                    help="first run one parallel torch op on this (the caller's) thread, as a user's own torch work "
                         "does: its OpenMP team outlives it, so the process holds more OpenMP threads than cores")
    ap.add_argument("--phases", action="store_true",
                    help="build the kernel with -DFINAL_PHASES: the decode layers' time per phase and thread, and "
                         "how much of it each thread waited in the team's barrier")
    ap.add_argument("--prefill", type=int, default=None, metavar="TOKENS",
                    help="instead: ms to prefill --batch prompts of TOKENS tokens (best of --steps)")
    ap.add_argument("--cached", type=int, default=0, metavar="TOKENS",
                    help="with --prefill: each prompt's first TOKENS tokens come from the prefix cache (a turn of a "
                         "conversation: one-token calls through engine.generate, a new tail each)")
    return ap.parse_args()


def remove_gemms() -> None:
    """--no-gemm: every weight matmul returns a preallocated result, so the step's time is what lies outside them."""
    from final.engine import linear

    outputs: dict = {}

    def fake(self, x):
        key = (tuple(x.shape[:-1]), self.out_features, x.dtype)
        if key not in outputs:
            outputs[key] = torch.zeros(*x.shape[:-1], self.out_features, dtype=x.dtype)
        return outputs[key]

    linear.Linear.__call__ = fake
    linear.Linear.add_to = lambda self, residual, x: residual + fake(self, x)
    os.environ["FINAL_GEMV"] = "0"  # torch's path: the kernel's whole-layer decode has no GEMMs to take out


def main() -> None:
    args = parse_args()
    if args.prefill:
        return cached_prefill_times(args) if args.cached else prefill_times(args)
    if args.phases:  # before the first engine loads the kernel: a build of its own (the flags are in its cache key)
        os.environ["FINAL_GEMV_CFLAGS"] = os.environ.get("FINAL_GEMV_CFLAGS", "") + " -DFINAL_PHASES"
    if args.other_team:
        torch.ones(2**24).sum()
    if args.isas or args.cflags is not None:
        return compare_isas(args)

    from final.engine import EmbeddedEngine
    from final.engine.sampling_params import SamplingParams
    from final.models import resolve_model_path

    if args.no_gemm:
        remove_gemms()

    engine = EmbeddedEngine(resolve_model_path(args.model), dtype=args.dtype, quantization=args.quantization)
    params = SamplingParams.from_dict({"max_new_tokens": 10_000, "temperature": 0})

    reads: list[float] = []
    kvs: list[int] = []

    weight_bytes = streamed_bytes(engine.model)
    try:
        cpus, walls, table = engine.call(lambda runner: timed_steps(engine, runner, args, params, reads, kvs))
    finally:
        engine.shutdown()
    if table:
        print(table)
    cpu, wall = statistics.median(cpus), statistics.median(walls)
    print(f"{args.dtype}{', ' + args.quantization if args.quantization else ''} batch {args.batch}, {args.threads} "
          f"thread(s){', no GEMM' if args.no_gemm else ''}{', another OpenMP team' if args.other_team else ''}: "
          f"{cpu * 1e3:.2f} ms CPU / {wall * 1e3:.2f} ms wall per decode step (median of {args.steps})")
    if args.roofline:
        print(roofline(weight_bytes, kvs, walls, reads))


def timed_steps(engine, runner, args, params, reads: list, kvs: list) -> tuple[list, list, str]:
    """The decode steps timed on the engine thread (runner: its ModelRunner); the machine's read rates and each
    step's K/V bytes are appended to reads and kvs for --roofline."""
    from gemv import memory_rates  # bench/gemv.py, beside this file

    torch.set_num_threads(args.threads)
    seqs, append = fresh_rows(engine, runner, args.batch, params)
    for _ in range(5):  # warm-up
        append(runner.decode(seqs))
    table = ""
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(10):
                append(runner.decode(seqs))
        table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=30)
    cpu, wall = [], []
    layers = phase_clock(runner)
    for i in range(args.steps):
        if args.roofline and i % 10 == 0:  # the machine's read rate, between the steps (its speed drifts)
            reads.append(memory_rates(3)[1])
        kvs.append(kv_bytes(runner.cache, seqs))
        c0, w0 = time.thread_time(), time.perf_counter()
        append(runner.decode(seqs))
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    if args.roofline:
        reads.append(memory_rates(3)[1])  # the last block's rate after it too
    if layers:
        table += layers(sum(wall))
    return cpu, wall, table


def roofline(weight_bytes: int, kvs: list[int], walls: list[float], reads: list[float]) -> str:
    """Every weight byte and the K/V of the context (kvs, a step's) are read once a step: the step's streaming rate
    against the machine's read rate (a 128 MB sum), each block of 10 steps against the mean of the rates taken just
    before and after it, since the host's memory speed drifts within a run (30-48 GB/s within minutes here); the
    median of the blocks' shares. The weights alone are given too."""
    shares, rates, alone = [], [], []
    for j, lo in enumerate(range(0, len(walls), 10)):
        wall = statistics.median(walls[lo:lo + 10])
        rate = (weight_bytes + statistics.median(kvs[lo:lo + 10])) / wall / 1e9
        rates.append(rate)
        read = (reads[j] + reads[min(j + 1, len(reads) - 1)]) / 2
        shares.append(rate / read)
        alone.append(weight_bytes / wall / 1e9 / read)
    return (f"roofline: {weight_bytes / 1e6:.0f} MB of weights + {min(kvs) / 1e6:.1f}-{max(kvs) / 1e6:.1f} MB of K/V a "
            f"step -> {statistics.median(rates):.1f} GB/s streamed by the whole step; this machine reads "
            f"{statistics.median(reads):.1f} GB/s (a 128 MB sum, median of "
            f"{len(reads)} taken between blocks of 10 steps, {min(reads):.1f}-{max(reads):.1f}): "
            f"{statistics.median(shares):.0%} of it (each block against the reads beside it; blocks "
            f"{min(shares):.0%}-{max(shares):.0%}; the weights alone {statistics.median(alone):.0%})")

PHASE_NAMES = ["norm + qkv", "attention", "o", "norm + gate|up", "SwiGLU", "down", "norm + lm_head"]  # PHASE(i)


def phase_clock(runner):
    """With a -DFINAL_PHASES kernel: times its decode_step calls from here on and returns the function that
    prints the split of the steps' wall time (None without such a kernel). Phases 0-5 are summed over the layers."""
    from final.engine.kernels import gemv_kernel

    kernel = gemv_kernel()
    if kernel is None or kernel.phase_cycles() is None:  # the call also zeroes the counts
        return None
    spent = []
    call = kernel.decode_step

    def timed(*a, **k):
        t = time.perf_counter()
        call(*a, **k)
        spent.append(time.perf_counter() - t)

    kernel.decode_step = timed  # this engine's calls only: the instance attribute

    def report(total: float) -> str:
        del kernel.decode_step
        cycles = kernel.phase_cycles().double()
        threads = int((cycles.sum(dim=(1, 2)) > 0).sum())
        cycles = cycles[:threads]
        per_ms = cycles[:, 0].sum(dim=1).max() / (sum(spent) * 1e3)  # the busiest thread's phases span the calls
        steps = len(spent)
        lines = [f"the kernel's call {sum(spent) / steps * 1e3:.3f} of {total / steps * 1e3:.3f} ms a step (the rest: "
                 f"Python); per phase, ms a step in it / of that waiting in a barrier, by thread:"]
        for i, name in enumerate(PHASE_NAMES[:cycles.shape[2]]):
            cols = "  ".join(f"{cycles[t, 0, i] / per_ms / steps:.3f} / {cycles[t, 1, i] / per_ms / steps:.3f}"
                             for t in range(threads))
            lines.append(f"  {name:15s} {cols}")
        return "\n".join(lines) + "\n"

    return report


def fresh_rows(engine, runner, batch: int, params) -> tuple[list, callable]:
    """batch new rows prefilled (prompts of 31.. tokens) and the function that appends a step's sampled tokens."""
    from final.engine.sampler import sample

    seqs = [engine._make_sequence(i, [1] + list(range(100, 130 + i)), params, 0, False, -1, None, ())
            for i in range(batch)]
    for slot, seq in enumerate(seqs):
        seq.slot = slot

    def append(logits) -> None:
        tokens, _, _ = sample(logits, seqs)
        for seq, tok in zip(seqs, tokens):
            seq.append(tok, None, None)

    append(runner.prefill(seqs))
    return seqs, append


def cached_prefill_times(args) -> None:
    """--prefill N --cached C: one-token calls whose first C tokens the prefix cache holds and whose N last are new
    each time (what a conversation's turn prefills), timed whole through engine.generate; best and median."""
    import random

    from final.engine import EmbeddedEngine
    from final.models import resolve_model_path

    engine = EmbeddedEngine(resolve_model_path(args.model), dtype=args.dtype, quantization=args.quantization,
                            max_model_len=args.cached + args.prefill + 8)
    rng = random.Random(0)
    head = [1] + [rng.randrange(100, 20_000) for _ in range(args.cached - 1)]
    params = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
    times = []
    try:
        engine.generate(head, params)  # the cache now holds the head
        for _ in range(args.steps + 1):
            prompts = [head + [rng.randrange(100, 20_000) for _ in range(args.prefill)] for _ in range(args.batch)]
            t = time.perf_counter()
            outs = engine.generate(prompts, params)
            times.append(time.perf_counter() - t)
        cached = [o["meta_info"]["cached_tokens"] for o in outs]
    finally:
        engine.shutdown()
    times = times[1:]  # the first builds oneDNN's kernels for the shape
    print(f"{args.dtype}: {args.batch} x {args.prefill} new tokens after {args.cached} cached (cached_tokens {cached}), "
          f"{args.threads} thread(s): {min(times) * 1e3:.1f} ms (best of {len(times)}), median "
          f"{statistics.median(times) * 1e3:.1f} ms")


def prefill_times(args) -> None:
    """The prompt's side of a call: one prefill of --batch rows of --prefill tokens each, best of --steps."""
    from final.engine import EmbeddedEngine
    from final.engine.sampling_params import SamplingParams
    from final.models import resolve_model_path

    engine = EmbeddedEngine(resolve_model_path(args.model), dtype=args.dtype, quantization=args.quantization)
    params = SamplingParams.from_dict({"max_new_tokens": 1, "temperature": 0})

    def body(runner) -> list[float]:
        torch.set_num_threads(args.threads)
        out = []
        for i in range(args.steps + 1):
            seqs = [engine._make_sequence(r, [1] + [100 + (r + i + t) % 1000 for t in range(args.prefill - 1)],
                                          params, 0, False, -1, None, ()) for r in range(args.batch)]
            for slot, seq in enumerate(seqs):
                seq.slot = slot
            t = time.perf_counter()
            runner.prefill(seqs)
            out.append(time.perf_counter() - t)
        return out[1:]  # the first builds oneDNN's kernels for the shape

    try:
        times = engine.call(body)
    finally:
        engine.shutdown()
    print(f"{args.dtype}{', ' + args.quantization if args.quantization else ''}: prefill of {args.batch} x "
          f"{args.prefill} tokens, {args.threads} thread(s): {min(times) * 1e3:.1f} ms (best of {len(times)}), "
          f"median {statistics.median(times) * 1e3:.1f} ms")


def compare_isas(args) -> None:
    """One engine per kernel build; each round runs every build's steps in turn (rotated), on fresh rows, so each
    build sees the same contexts and the host's drift falls on all of them."""
    from final.engine import EmbeddedEngine, kernels
    from final.engine.sampling_params import SamplingParams
    from final.models import resolve_model_path
    from gemv import memory_rates

    params = SamplingParams.from_dict({"max_new_tokens": 10_000, "temperature": 0})
    engines = {}
    isas = args.isas.split(",") if args.isas else kernels.candidate_isas()[:1]
    builds = [(isa, "") for isa in isas] if args.cflags is None else [(isas[0], c) for c in args.cflags.split("|")]
    for isa, cflags in builds:
        os.environ["FINAL_GEMV_CFLAGS"] = cflags  # read by the build (its cache key too)
        kernels.use(isa)
        engines[f"{isa} {cflags}".strip()] = EmbeddedEngine(resolve_model_path(args.model), dtype=args.dtype,
                                                            quantization=args.quantization)

    def steps(engine, runner) -> list[float]:
        torch.set_num_threads(args.threads)
        seqs, append = fresh_rows(engine, runner, args.batch, params)
        for _ in range(3):
            append(runner.decode(seqs))
        out = []
        for _ in range(args.steps // 4 or 1):
            kv = kv_bytes(runner.cache, seqs)
            t = time.perf_counter()
            logits = runner.decode(seqs)
            out.append(time.perf_counter() - t)
            step_kv.append(kv)
            append(logits)
        return out

    times: dict[str, list[float]] = {isa: [] for isa in engines}
    reads, step_kv = [], []
    names = list(engines)
    try:
        for r in range(args.rounds):
            if args.roofline and r % 4 == 0:
                reads.append(memory_rates(3)[1])
            for isa in names[r % len(names):] + names[: r % len(names)]:
                time.sleep(0.05)  # each engine thread has its own OpenMP team: let the last one's stop spinning
                times[isa] += engines[isa].call(lambda runner, e=engines[isa]: steps(e, runner))
        weight_bytes = streamed_bytes(engines[names[0]].model)
    finally:
        for engine in engines.values():
            engine.shutdown()
    base = statistics.median(times[names[0]])
    read = statistics.median(reads) if reads else None
    print(f"{args.dtype}{', ' + args.quantization if args.quantization else ''} batch {args.batch}, {args.threads} "
          f"thread(s){', another OpenMP team' if args.other_team else ''}, {args.rounds} rounds: wall ms per decode "
          "step (median), by kernel build")
    for isa in names:
        step = statistics.median(times[isa])
        line = f"  {isa:30s} {step * 1e3:.2f} ms  {base / step:.3f}x {names[0]}"
        if read:
            rate = (weight_bytes + statistics.median(step_kv)) / step / 1e9  # weights + K/V (kv_bytes)
            line += f"  {rate:.1f} GB/s streamed, {rate / read:.0%} of {read:.1f}"
        print(line)


if __name__ == "__main__":
    main()
