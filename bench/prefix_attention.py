"""Where P2's cartridge TTFT goes as p grows: the question's attention over the cartridge, against the machine.

    python bench/prefix_attention.py                 # SmolLM2-135M's shapes, p = 512 ... 7168, 10 question tokens
    python bench/prefix_attention.py --question 10 --lengths 512 7168 --repeats 20

P2 (`final bench --only p2`) times a 10-token question over a p-token cartridge. Its products read the same
weights at every p; what grows with p is each layer's attention of the question's rows over the prefix K/V:
2 x 2 x H x q x p x D FLOPs and 2 x Hkv x p x D x 4 bytes a layer. This times exactly that call
(final.engine.attention.attend_prefix, the engine's path: the kernel's final_prefix_attend, kernels/prefill.h) for
every layer's worth, beside the path it replaced (PyTorch's CPU flash kernel, keys split one chunk per thread,
merged by log-sum-exp: attention._flash_prefix), alternating in one process, and a large fp32 matmul as the
machine's practical FLOP rate; it prints what the spread of the TTFT would be if the attention ran at that rate:
the floor no kernel on these cores can beat.
"""

from __future__ import annotations

import argparse
import time

import torch


def best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 7168])
    ap.add_argument("--question", type=int, default=10, help="question tokens (P2's: 10)")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()

    from final.engine.attention import _flash_prefix, attend_prefix
    from final.engine.kv_cache import PrefixKV

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2048, 2048, generator=g), torch.randn(2048, 2048, generator=g)
    peak = 2 * 2048**3 / best_of(lambda: a @ b, args.repeats) / 1e9
    H, Hkv, D, q = args.heads, args.kv_heads, args.head_dim, args.question
    print(f"{torch.get_num_threads()} threads; fp32 matmul 2048^2: {peak:.0f} GFLOP/s; {q} question tokens, "
          f"{H} heads / {Hkv} KV heads of {D}, {args.layers} layers")
    print("| p | attention, all layers | GFLOP | GFLOP/s | torch flash (split keys), all layers | prefix K/V read |")
    print("|---:|---:|---:|---:|---:|---:|")
    rows = []
    for p in args.lengths:
        prefix = PrefixKV(("bench",), [torch.randn(Hkv, p, D, generator=g)], [torch.randn(Hkv, p, D, generator=g)])
        qg = torch.randn(1, Hkv, H // Hkv, q, D, generator=g)
        flat = qg.permute(1, 0, 2, 3, 4).reshape(Hkv, H // Hkv * q, D)
        ours, torch_s = float("inf"), float("inf")
        for _ in range(3):  # alternating, so a noisy neighbour slows both
            ours = min(ours, best_of(lambda: attend_prefix(qg, prefix, 0, D**-0.5), args.repeats))
            torch_s = min(torch_s, best_of(lambda: _flash_prefix(flat, prefix.k[0], prefix.v[0], D**-0.5),
                                           args.repeats))
        layer_s = ours
        flop = 2 * 2 * H * q * p * D * args.layers
        rows.append((p, layer_s * args.layers, flop))
        print(f"| {p} | {layer_s * args.layers * 1e3:.1f} ms | {flop / 1e9:.2f} | {flop / layer_s / args.layers / 1e9:.0f} "
              f"| {torch_s * args.layers * 1e3:.1f} ms | {2 * Hkv * p * D * 4 * args.layers / 1e6:.0f} MB |")
    (p0, t0, f0), (p1, t1, f1) = rows[0], rows[-1]
    print(f"from p={p0} to p={p1} the attention adds {(t1 - t0) * 1e3:.1f} ms; at the matmul's rate it would add "
          f"{(f1 - f0) / peak / 1e6:.1f} ms. TTFT spread floor = (T_{p0} + that) / T_{p0} for the T_{p0} you "
          f"measure with `final bench --only p2`.")


if __name__ == "__main__":
    main()
