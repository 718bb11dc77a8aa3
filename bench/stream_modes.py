"""The kernel's weight stream against the machine's read rate, in both of the host's memory modes, build beside build.

    python bench/stream_modes.py --seconds 120 --cflags "|-DPF_PAGE=0"

The host this was written on has two memory modes that flip within seconds: a 128 MB sum reads ~30 GB/s most of
the time and 40-50 GB/s in spells too short for a whole benchmark (bench/RESULTS.md). So this loops for --seconds
over short samples, each: the sum's read rate, then every build's int8 and fp32 products over weights far larger
than the caches (8 x 28 MB int8 lm_head-shaped matrices with their scales, 3 x 113 MB fp32; one activation row,
each call streaming its matrix once), then the sum again; and files each sample under the mode the two reads beside
it show. It prints, per mode, each build's median GB/s and its median ratio to the reads beside it. Builds are
gemv.c compiled with each `--cflags` entry added (its #ifndef knobs), for the best ISA here or --isa.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def _rate(nbytes: int, fn) -> float:
    t = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--cflags", default="", help="|-separated gcc flags, one build each ('' is the default build)")
    ap.add_argument("--isa", default=None, help="a build of final.engine.kernels.ISAS (default: the best here)")
    ap.add_argument("--fast", type=float, default=40.0, help="GB/s of the sum at and above which a sample is 'fast'")
    ap.add_argument("--slow", type=float, default=35.0, help="GB/s of the sum below which a sample is 'slow'")
    args = ap.parse_args()

    from final.engine import kernels
    from gemv import read_rate  # bench/gemv.py, beside this file

    isa = args.isa or kernels.candidate_isas()[0]
    builds = {}
    for cflags in args.cflags.split("|"):
        os.environ["FINAL_GEMV_CFLAGS"] = cflags  # read by the build (its cache key too)
        builds[cflags or "default"] = kernels.load(isa)
    g = torch.Generator().manual_seed(0)
    int8 = [kernels.quantize(torch.randn(49152, 576, generator=g) * 0.02) for _ in range(8)]
    fp32 = [torch.randn(49152, 576, generator=g) * 0.02 for _ in range(3)]
    x = torch.randn(1, 576)
    big = torch.ones(128 * 2**20 // 4)  # read_rate's, made once
    int8_bytes = sum(q.nbytes + s.nbytes for q, s in int8)
    fp32_bytes = sum(w.nbytes for w in fp32)

    samples = []
    end = time.time() + args.seconds
    while time.time() < end:
        before = read_rate(2, big)
        row = {}
        for name, k in builds.items():
            row[f"int8 {name}"] = _rate(int8_bytes, lambda k=k: [k(x, q, scale=s) for q, s in int8])
            row[f"fp32 {name}"] = _rate(fp32_bytes, lambda k=k: [k(x, w) for w in fp32])
        samples.append(((before + read_rate(2, big)) / 2, row))
    print(f"{isa} builds, {len(samples)} samples over {args.seconds:.0f} s, {torch.get_num_threads()} threads; "
          "GB/s streamed (median), and its median ratio to the sum's read beside it")
    for mode, keep in (("fast", lambda r: r >= args.fast), ("between", lambda r: args.slow <= r < args.fast),
                       ("slow", lambda r: r < args.slow)):
        group = [(r, row) for r, row in samples if keep(r)]
        if not group:
            continue
        print(f"{mode}: {len(group)} samples, the sum reads {statistics.median(r for r, _ in group):.1f} GB/s")
        for key in group[0][1]:
            rate = statistics.median(row[key] for _, row in group)
            share = statistics.median(row[key] / r for r, row in group)
            print(f"  {key:32s} {rate:5.1f} GB/s  {share:.2f}")


if __name__ == "__main__":
    main()
