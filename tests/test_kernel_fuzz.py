"""A fuzz of the C kernel's boundary against torch: hundreds of random products (row counts, odd N and K, every
weight kind, prep and epilogue) and whole decode steps (heads and KV heads, head sizes, rows, cached lengths up to
the cache's last slot, cartridge prefixes and prefix-cache segments, biases or none) and the torch forward's decode
attention (final_attend), seeded so a failure names a case that reproduces."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from final.engine import kernels
from final.engine.kernels import PREP_GLU, PREP_NONE, PREP_NORM, check

KERNEL = kernels.gemv_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the engine's kernel does not run here (no gcc or AVX2)")
# every build this CPU runs (its flags checked: avx2 alone on a CI machine without AVX-512)
ISAS_HERE = kernels.candidate_isas() if KERNEL is not None else []
KINDS = (torch.float32, torch.bfloat16, torch.int8)


def product_case(kernel, r: random.Random, g: torch.Generator) -> tuple[str, torch.Tensor, torch.Tensor, float]:
    kind = r.choice(KINDS)
    m = r.choice([1, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33])
    if kind == torch.int8:
        n, k = 16 * r.randint(1, 6), 32 * r.randint(1, 5)
    else:
        n, k = r.randint(1, 70), r.randint(1, 90)
    prep = r.choice([PREP_NONE, PREP_NORM, PREP_GLU])
    w, scale, ref = check.as_kind(torch.randn(n, k, generator=g) / k ** 0.5, kind)
    x = torch.randn(m, 2 * k if prep == PREP_GLU else k, generator=g)
    bias = torch.randn(n, generator=g) if r.random() < 0.5 else None
    res = torch.randn(m, n, generator=g) if r.random() < 0.5 else None
    norm = torch.randn(k, generator=g)
    h = x if prep == PREP_NONE else F.rms_norm(x, (k,), norm, 1e-5) if prep == PREP_NORM else \
        F.silu(x[:, :k]) * x[:, k:]
    want = F.linear(h, ref, bias) + (res if res is not None else 0)
    got = kernel(x, w, bias, res, prep, norm if prep == PREP_NORM else None, 1e-5, scale=scale)
    # bf16 dot products of an AVX512-BF16 build carry x as two bf16 halves (2^-16 of |w| |x|); int8's int16 x
    slack = (h.abs() @ ref.abs().T).max().item() * 2.0**-15 if kind != torch.float32 else 0.0
    return f"{kind} m={m} n={n} k={k} prep={prep}", got, want, 1e-4 * (1 + want.abs().max().item()) + slack


@needs_kernel
@pytest.mark.parametrize("isa", ISAS_HERE)
def test_random_products_match_torch(isa):
    kernel = kernels.load(isa)
    r, g = random.Random(11), torch.Generator().manual_seed(11)
    for i in range(300):
        name, got, want, tol = product_case(kernel, r, g)
        err = (got - want).abs().max().item()
        assert err <= tol, f"case {i} ({name}): {err:.3g} > {tol:.3g}"


def step_case(r: random.Random, g: torch.Generator) -> check.DecodeCase:
    kind = r.choice(KINDS)
    hkv = r.choice([1, 2, 3])
    heads = hkv * r.choice([1, 2, 3])
    d = r.choice([2, 6, 8, 16, 24]) if kind != torch.int8 else r.choice([8, 16, 32])
    if kind == torch.int8:  # whole int8 blocks and groups: H D and (H + 2 Hkv) D
        while (heads * d) % 32 or ((heads + 2 * hkv) * d) % 16:
            heads, hkv = heads * 2, hkv * 2
        hidden, inter, vocab = 32 * r.randint(1, 3), 32 * r.randint(1, 3), 16 * r.randint(1, 4)
    else:
        hidden, inter, vocab = r.randint(4, 80), r.randint(4, 80), r.randint(2, 70)
    t = r.randint(1, 24)
    m = r.choice([1, 1, 2, 3, 4, 5, 8, 11])
    lengths = [r.choice([0, t - 1, r.randint(0, t - 1)]) for _ in range(m)]  # the cache's first and last slots
    segments = r.choice([1, 1, 2, 3])  # a cartridge, or a cartridge and the prefix cache's nodes
    plens = [[r.choice([0, 0, 1, r.randint(1, 40)]) for _ in range(segments)] for _ in range(m)]
    return check.decode_case(g, kind, lengths, plens, hidden=hidden, inter=inter, H=heads, Hkv=hkv, D=d,
                             layers=r.randint(1, 2), T=t, vocab=vocab, biases=r.random() < 0.5)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS_HERE)
def test_random_decode_steps_match_torch(isa):
    kernel = kernels.load(isa)
    r, g = random.Random(12), torch.Generator().manual_seed(12)
    for i in range(100):
        case = step_case(r, g)
        err = check.step_error(kernel, case)
        assert err <= check.STEP_TOL, (f"case {i}: {case.kind} H={case.H} Hkv={case.Hkv} D={case.D} T={case.T} "
                                       f"lengths={case.lengths} prefixes={case.plens}: {err:.3g}")


@needs_kernel
@pytest.mark.parametrize("isa", ISAS_HERE)
def test_decode_attention_alone_matches_torch(isa):
    """final_attend (the torch forward's decode attention, rows past the whole-step call's) over random segments."""
    kernel = kernels.load(isa)
    r, g = random.Random(13), torch.Generator().manual_seed(13)
    for i in range(60):
        hkv, layers = r.choice([1, 2, 3]), r.randint(1, 3)
        heads, d, t, m, width = hkv * r.choice([1, 2, 3]), r.choice([2, 8, 16, 64]), r.randint(1, 20), \
            r.randint(1, 12), r.randint(1, 3)
        kc, vc = torch.randn(m, hkv, t, d, generator=g), torch.randn(m, hkv, t, d, generator=g)
        lengths = torch.tensor([r.randint(0, t - 1) for _ in range(m)])
        plens = torch.tensor([[r.choice([0, 1, r.randint(1, 30)]) for _ in range(width)] for _ in range(m)])
        segs = [[[(torch.randn(hkv, int(p), d, generator=g), torch.randn(hkv, int(p), d, generator=g))
                  for _ in range(layers)] for p in row] for row in plens]
        ptab = torch.tensor([[[[k.data_ptr(), v.data_ptr()] for k, v in seg] for seg in row] for row in segs],
                            dtype=torch.int64)
        q, layer = torch.randn(m, heads, d, generator=g), r.randrange(layers)
        got = kernel.attend(q, kc, vc, lengths, (ptab, plens), layer, d ** -0.5)
        for b in range(m):
            n = int(lengths[b]) + 1
            keys = torch.cat([seg[layer][0] for seg in segs[b]] + [kc[b, :, :n]], 1)
            values = torch.cat([seg[layer][1] for seg in segs[b]] + [vc[b, :, :n]], 1)
            want = check._attend(q[b], keys, values, d ** -0.5)
            err = (got[b] - want).abs().max().item()
            assert err < 1e-5, f"case {i} row {b}: H={heads} Hkv={hkv} D={d} n={n} prefixes={plens[b].tolist()}"


@needs_kernel
@pytest.mark.parametrize("isa", ISAS_HERE)
def test_prefill_attention_over_a_prefix_matches_torch(isa):
    """final_prefix_attend (a prefill's queries over a cartridge or cached prefix: output and log-sum-exp) against
    softmax attention in float64, on contiguous segments and on views into a row's slot (heads T tokens apart)."""
    kernel = kernels.load(isa)
    r, g = random.Random(14), torch.Generator().manual_seed(14)
    for i in range(40):
        hkv, d, m, n = r.choice([1, 2, 3]), r.choice([4, 16, 64]), r.choice([1, 3, 30, 33, 97]), \
            r.choice([1, 5, 127, 128, 129, 700])
        q = torch.randn(hkv, m, d, generator=g)
        slot = r.random() < 0.5  # a view of the first n tokens of a [Hkv, T, D] slot
        k = torch.randn(hkv, n + 7 * slot, d, generator=g)[:, :n]
        v = torch.randn(hkv, n + 7 * slot, d, generator=g)[:, :n]
        o, lse = kernel.prefix_attend(q, k, v, d ** -0.5)
        s = (q.double() @ k.double().transpose(1, 2)) * d ** -0.5
        want_lse = torch.logsumexp(s, -1)
        want_o = torch.softmax(s, -1) @ v.double()
        assert (o.double() - want_o).abs().max() < 1e-5, f"case {i}: Hkv={hkv} D={d} M={m} n={n} slot={slot}"
        assert (lse.double() - want_lse).abs().max() < 1e-4, f"case {i}: lse"
