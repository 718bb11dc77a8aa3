"""Decode with a cartridge: the engine's kernel path (whole layers in one C call, the prefix attended inside it)
beside torch's path (FINAL_GEMV=0: the layer loop, the prefix as a second attention segment), side by side.

    python bench/cartridge_decode.py                           # p = 0, 64, 1024; batch 1 and 8; 64 new tokens
    python bench/cartridge_decode.py --lengths 0 2048 --batches 8 --repeats 5

Every row of a batch uses the same cartridge (random post-RoPE K/V of the exact shape: timing does not depend on the
values); greedy, a fixed number of new tokens. Each figure is a whole `generate` call (prefill of a 20-token prompt
plus the new tokens), tokens a second, the median of alternating repeats; the two paths' greedy tokens are compared
too (the kernel's fp32 sums are ordered differently, so a near-tie may differ).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def engine_for(path: str, kernel: bool, rows: int):
    from final.engine import EmbeddedEngine

    os.environ["FINAL_GEMV"] = "1" if kernel else "0"  # read when the engine loads its weights
    try:
        return EmbeddedEngine(path, dtype="float32", max_running_requests=rows)
    finally:
        os.environ.pop("FINAL_GEMV")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--lengths", type=int, nargs="+", default=[0, 64, 1024], help="cartridge tokens (0: none)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from final.bench.timing import machine
    from final.bench.ttft import random_cartridge
    from final.models import resolve_model_path

    path = resolve_model_path(args.model)
    rows = max(args.batches)
    engines = {"kernel": engine_for(path, True, rows), "torch": engine_for(path, False, rows)}
    assert engines["kernel"].model.kernel is not None, "the kernel does not run on this machine"
    params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
    prompts = [[1] + list(range(100 + i, 120 + i)) for i in range(rows)]
    m = machine("cpu")
    print(f"{m['date']}, {m['cpu']} ({m['cores']} cores, load {m.get('loadavg_1min', '?')}); {args.model}, fp32, {torch.get_num_threads()} threads, {args.new_tokens} new tokens, "
          f"median of {args.repeats}")
    print("| cartridge tokens | batch | kernel tok/s | torch path tok/s | kernel / torch | rows identical |")
    print("|---:|---:|---:|---:|---:|---:|")
    try:
        for p in args.lengths:
            for e in engines.values():  # made on the engine thread, as the engine's own loads are
                if p:
                    e.call(lambda _r, e=e: e.load_cartridge(f"c{p}", *random_cartridge(e, p, seed=p)))
            for batch in args.batches:
                times: dict[str, list[float]] = {name: [] for name in engines}
                ids: dict[str, list] = {}
                carts = (f"c{p}",) if p else ()
                for _ in range(args.repeats + 1):  # the first round warms up
                    for name, e in engines.items():
                        t = time.perf_counter()
                        out = e.generate(prompts[:batch], params, cartridges=carts)
                        times[name].append(time.perf_counter() - t)
                        ids[name] = [o["output_ids"] for o in out]
                tok = {name: batch * args.new_tokens / statistics.median(t[1:]) for name, t in times.items()}
                same = sum(a == b for a, b in zip(ids["kernel"], ids["torch"]))
                ratio = tok["kernel"] / tok["torch"]
                print(f"| {p} | {batch} | {tok['kernel']:.1f} | {tok['torch']:.1f} | {ratio:.2f}x | {same}/{batch} |")
            for e in engines.values():
                if p:
                    e.unload_cartridge(f"c{p}")
    finally:
        for e in engines.values():
            e.shutdown()


if __name__ == "__main__":
    main()
