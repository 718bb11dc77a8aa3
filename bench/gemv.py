"""Decode's weight products on this CPU: GB/s of weights streamed per kernel, SmolLM2-135M's shapes, side by side.

    python bench/gemv.py                      # M = 1 2 4 8 16, torch's thread count
    python bench/gemv.py --threads 1 --m 1 8
    python bench/gemv.py --int8              # + int8 weights: our kernel (weight-only) and fbgemm (dynamic)
    python bench/gemv.py --bf16              # + bf16 weights: our kernel (fp32 activations) and torch bf16

Candidates: the engine's own kernel (final/engine/kernels/gemv.c), torch's `F.linear` on the dense weight (MKL),
oneDNN on a weight reordered into its blocked layout (`mkldnn._linear_pointwise`, the engine's path before the
kernel), and numpy's bundled OpenBLAS (`x @ W.T`, fp32). One step's worth of products (every layer's qkv, o,
gate|up, down and the lm_head) is timed as a whole, best of --repeats, each weight its own tensor (538 MB in
all, so nothing is served from cache), alternating kernels within a repeat. Also the machine's memcpy of 64 MB,
(read + write)/time, and its read-only rate (a sum), for the roofline.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F

from final.bench import timing

# SmolLM2-135M: hidden 576, intermediate 1536, 30 layers, 9 + 2x3 heads of 64, vocab 49152 (tied lm_head)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def memory_rates(repeats: int) -> tuple[float, float]:
    """GB/s of a 64 MB memcpy, (read + write) / time, and read_rate's; the best of `repeats` each."""
    a = torch.ones(16 * 2**20)
    b = torch.empty_like(a)
    copy = min(timing.timed(lambda: b.copy_(a))[0] for _ in range(repeats))
    return 2 * a.nbytes / copy / 1e9, read_rate(repeats)


def read_rate(repeats: int, big: torch.Tensor | None = None) -> float:
    """GB/s of final.bench.timing.read_rate (a sum over 128 MB or `big`, the best of `repeats`)."""
    return timing.read_rate(repeats, big) / 1e9


def _fbgemm(w: torch.Tensor):
    """w prepacked for fbgemm's dynamic int8 linear (int8 with a scale per row; the activations quantized per
    call), as the engine's int8 ran before it ran on its own kernel only."""
    import warnings

    scale = (w.abs().amax(dim=1).double() / 127).clamp_min(1e-12)
    with warnings.catch_warnings():  # torch marks quantized tensor creation deprecated; fbgemm still needs it
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w.float(), scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, None)


def candidates(weights: list[torch.Tensor], int8: bool, bf16: bool) -> dict:
    """name -> (one step's products, bytes of weights they read)."""
    from final.engine.kernels import gemv_kernel

    out = {}
    fp32 = sum(w.nbytes for w in weights)
    kernel = gemv_kernel()
    if kernel is not None:
        out["final gemv.c"] = (lambda xs: [kernel(xs[w.shape[1]], w) for w in weights], fp32)
    out["F.linear (MKL, dense)"] = (lambda xs: [F.linear(xs[w.shape[1]], w) for w in weights], fp32)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
    out["oneDNN packed"] = (lambda xs: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [None], "")
                                        for w, p in zip(weights, packed)], fp32)
    arrays = [w.numpy() for w in weights]
    out["numpy OpenBLAS"] = (lambda xs: [xs[a.shape[1]].numpy() @ a.T for a in arrays], fp32)
    if int8:  # weight-only int8 (one scale per row) on our kernel, and fbgemm's dynamic int8 (the old int8 mode)
        from final.engine.kernels import quantize

        qs, scales = zip(*(quantize(w) for w in weights))  # the engine's: a scale per 32 weights
        if kernel is not None:
            out["final gemv.c int8"] = (lambda xs: [kernel(xs[q.shape[1]], q, scale=s) for q, s in zip(qs, scales)],
                                        fp32 * 9 // 32)  # + a 4-byte scale per 32
        fb = [(w.shape[1], _fbgemm(w)) for w in weights]  # the old int8 mode, kept here for the comparison
        out["fbgemm int8 (dynamic)"] = (lambda xs: [torch.ops.quantized.linear_dynamic(xs[k], p, True) for k, p in fb],
                                        fp32 // 4)
    if bf16:  # bf16 weights: ours with fp32 activations (quantization: bf16), torch's bf16 x bf16 (dtype: bfloat16)
        halves = [w.bfloat16() for w in weights]
        if kernel is not None:
            out["final gemv.c bf16"] = (lambda xs: [kernel(xs[h.shape[1]], h) for h in halves], fp32 // 2)
        out["F.linear bf16"] = (lambda xs: [F.linear(xs[h.shape[1]].bfloat16(), h) for h in halves], fp32 // 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--int8", action="store_true", help="also int8 weights: our kernel and fbgemm's")
    ap.add_argument("--bf16", action="store_true", help="also bf16 weights: our kernel and torch's bf16 product")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) * 0.02 for n, k in SHAPES]
    nbytes = sum(w.nbytes for w in weights)
    copy, read = memory_rates(args.repeats)
    print(f"threads {args.threads}; weights {nbytes / 1e6:.0f} MB a step; memcpy {copy:.1f} GB/s (read+write), "
          f"read (sum) {read:.1f} GB/s")
    kernels = candidates(weights, args.int8, args.bf16)
    print("GB/s of the weights each kernel reads (fp32, or int8/bf16 where named); steps a second in brackets")
    print("| M | " + " | ".join(kernels) + " |")
    print("|---:|" + "---:|" * len(kernels))
    for m in args.m:
        xs = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
        best = dict.fromkeys(kernels, float("inf"))
        for _ in range(args.repeats):
            for name, (fn, _) in kernels.items():
                best[name] = min(best[name], timing.timed(lambda: fn(xs))[0])
        cells = [f"{kernels[name][1] / t / 1e9:.1f} ({1 / t:.0f}/s)" for name, t in best.items()]
        print(f"| {m} | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
