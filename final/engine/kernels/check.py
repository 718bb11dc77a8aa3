"""The kernel against torch: its products (every prep and epilogue, batch 1 and a few rows, each weight kind) and
whole decode steps of a small random model (decode_case + reference_step), at load time (self_check: a build that
disagrees is not used) and in tests/test_kernel_fuzz.py (random shapes, row counts, lengths at the cache's end).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from final.engine.kernels import PREP_GLU, PREP_NORM, abi, address, dequantize, quantize
from final.engine.kernels.builds import KernelError


def as_kind(w: torch.Tensor, kind: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """w fp32 [N, K] as the kernel takes it in `kind` (weight, int8 scale or None) and the fp32 weight it then
    multiplies by (the reference's)."""
    if kind == torch.int8:
        q, scale = quantize(w)
        return q, scale, dequantize(q, scale)
    if kind == torch.bfloat16:
        return w.bfloat16(), None, w.bfloat16().float()
    return w, None, w


def product_cases(kernel, g: torch.Generator) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Every prep and epilogue on odd shapes (tails of rows, of K and of row pairs) at 1 and 3 rows, and each
    weight kind with bias and residual: (name, kernel's, torch's)."""
    out = []
    for m in (1, 3):
        w, x = torch.randn(13, 37, generator=g), torch.randn(m, 74, generator=g)
        bias, res, norm = torch.randn(13, generator=g), torch.randn(m, 13, generator=g), torch.randn(37, generator=g)
        x37 = x[:, :37].contiguous()
        out += [(f"fp32 m={m}", kernel(x37, w), F.linear(x37, w)),
                (f"bias+res m={m}", kernel(x37, w, bias, res), res + F.linear(x37, w, bias)),
                (f"norm m={m}", kernel(x37, w, prep=PREP_NORM, norm=norm, eps=1e-6),
                 F.linear(F.rms_norm(x37, (37,), norm, 1e-6), w)),
                (f"glu m={m}", kernel(x, w, res=res, prep=PREP_GLU), res + F.linear(F.silu(x37) * x[:, 37:], w))]
        w64, b32, r32 = torch.randn(32, 64, generator=g), torch.randn(32, generator=g), torch.randn(m, 32, generator=g)
        x64 = x[:, :64].contiguous()
        for kind in (torch.int8, torch.bfloat16):
            weight, scale, ref = as_kind(w64, kind)
            out.append((f"{kind} m={m}", kernel(x64, weight, b32, r32, scale=scale), r32 + F.linear(x64, ref, b32)))
    return out


@dataclass
class DecodeCase:
    """A small random model in the kernel's tables, a step's rows and caches (the tensors kept alive here)."""
    kind: torch.dtype
    ids: list[int]
    positions: list[int]
    lengths: list[int]
    plens: list  # per row: a prefix's tokens (0: none), or a list of segments' tokens (a cartridge, cached prefixes)
    H: int
    Hkv: int
    D: int
    inter: int
    T: int
    embed: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    refs: list[dict] = field(default_factory=list)  # per layer: fp32 weights, biases, norms (the reference's)
    kept: list = field(default_factory=list)  # the kernel-format tensors the tables point at
    caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # [M, Hkv, T, D] K, V
    prefixes: list[list[list[tuple[torch.Tensor, torch.Tensor]]]] = field(default_factory=list)  # [row][seg][layer]
    head: dict = field(default_factory=dict)


def _segments(plens: list) -> list[list[int]]:
    """Each row's prefix segments' tokens: an int is one segment (0: none)."""
    return [list(p) if isinstance(p, (list, tuple)) else [p] for p in plens]


def decode_case(g: torch.Generator, kind: torch.dtype, lengths: list[int], plens: list, *, hidden: int = 64,
                inter: int = 64, H: int = 4, Hkv: int = 2, D: int = 16, layers: int = 2, T: int = 16,
                vocab: int = 48, biases: bool = True) -> DecodeCase:
    """A model of `layers` decoder layers with random weights (in `kind`), rows at `lengths` cached tokens (each
    < T) with prefixes of `plens` tokens (a list per row: segments, attended in order), and random ids and
    positions."""
    m = len(lengths)
    pos = torch.randint(0, 4 * T, (m,), generator=g).tolist()
    emb = torch.randn(vocab, hidden, generator=g)
    freqs = torch.outer(torch.arange(4 * T, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, D, 2) / D))
    ang = torch.cat((freqs, freqs), dim=-1)
    sin = torch.cat((-ang.sin()[:, : D // 2], ang.sin()[:, D // 2:]), dim=-1).contiguous()
    case = DecodeCase(kind, torch.randint(0, vocab, (m,), generator=g).tolist(), pos, lengths, plens, H, Hkv, D,
                      inter, T, emb, ang.cos().contiguous(), sin)

    def mat(n: int, k: int) -> torch.Tensor:
        w, scale, ref = as_kind(torch.randn(n, k, generator=g) / k ** 0.5, kind)
        case.kept += [w, scale]
        return ref, w, scale

    def vec(n: int, on: bool, base: float = 0.0) -> torch.Tensor | None:
        return (base + torch.randn(n, generator=g) * 0.1) if on else None

    nqkv = (H + 2 * Hkv) * D
    for _ in range(layers):
        shapes = {"qkv": (nqkv, hidden), "o": (hidden, H * D), "gu": (2 * inter, hidden), "d": (hidden, inter)}
        ref = {name: mat(*shape) for name, shape in shapes.items()}
        ref.update({f"b_{name}": vec(shape[0], biases) for name, shape in shapes.items()})
        ref.update(n_in=vec(hidden, True, 1.0), n_post=vec(hidden, True, 1.0))
        case.refs.append(ref)
        case.caches.append((torch.randn(m, Hkv, T, D, generator=g), torch.randn(m, Hkv, T, D, generator=g)))
    case.prefixes = [[[(torch.randn(Hkv, p, D, generator=g), torch.randn(Hkv, p, D, generator=g))
                       for _ in range(layers)] for p in segs] for segs in _segments(plens)]
    case.head = {"w": mat(vocab, hidden), "norm": vec(hidden, True, 1.0)}
    return case


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, D], keys/values [Hkv, n, D] -> [H D] (each group of H / Hkv heads on its KV head)."""
    rep = q.shape[0] // keys.shape[0]
    k, v = keys.repeat_interleave(rep, 0), values.repeat_interleave(rep, 0)
    return (torch.softmax((q[:, None] @ k.transpose(1, 2))[:, 0] * scale, -1)[:, None] @ v)[:, 0].reshape(-1)


def reference_step(case: DecodeCase, eps: float = 1e-6) -> tuple[torch.Tensor, list]:
    """The step in torch: logits [M, vocab] and the caches after it (the new K/V written at each row's length)."""
    H, Hkv, D = case.H, case.Hkv, case.D
    scale = D ** -0.5
    x = case.embed[case.ids]
    cos, sin = case.cos[case.positions], case.sin[case.positions]

    def rope(t: torch.Tensor) -> torch.Tensor:  # [M, heads, D]
        return t * cos[:, None] + t.roll(D // 2, dims=-1) * sin[:, None]

    caches = [(k.clone(), v.clone()) for k, v in case.caches]
    for layer, ref, (kc, vc) in zip(range(len(caches)), case.refs, caches):
        qkv = F.linear(F.rms_norm(x, (x.shape[1],), ref["n_in"], eps), ref["qkv"][0], ref["b_qkv"])
        q = rope(qkv[:, : H * D].view(-1, H, D))
        k = rope(qkv[:, H * D: (H + Hkv) * D].view(-1, Hkv, D))
        v = qkv[:, (H + Hkv) * D:].view(-1, Hkv, D)
        outs = []
        for b, n in enumerate(case.lengths):
            kc[b, :, n], vc[b, :, n] = k[b], v[b]
            segs = [layers[layer] for layers in case.prefixes[b]]
            outs.append(_attend(q[b], torch.cat([k for k, _ in segs] + [kc[b, :, : n + 1]], 1),
                                torch.cat([v for _, v in segs] + [vc[b, :, : n + 1]], 1), scale))
        x = x + F.linear(torch.stack(outs), ref["o"][0], ref["b_o"])
        gu = F.linear(F.rms_norm(x, (x.shape[1],), ref["n_post"], eps), ref["gu"][0], ref["b_gu"])
        gate, up = gu.chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, ref["d"][0], ref["b_d"])
    return F.linear(F.rms_norm(x, (x.shape[1],), case.head["norm"], eps), case.head["w"][0]), caches


def run_step(kernel, case: DecodeCase, eps: float = 1e-6) -> torch.Tensor:
    """The same step on the kernel (case.caches written in place): logits [M, vocab]."""
    def addr(ref: dict, name: str) -> int:
        return address(ref[name])

    rows = []
    for ref in case.refs:
        fields = {"w_qkv": ref["qkv"][1], "w_o": ref["o"][1], "w_gu": ref["gu"][1], "w_d": ref["d"][1],
                  "s_qkv": ref["qkv"][2], "s_o": ref["o"][2], "s_gu": ref["gu"][2], "s_d": ref["d"][2],
                  "b_qkv": ref["b_qkv"], "b_o": ref["b_o"], "b_gu": ref["b_gu"], "b_d": ref["b_d"],
                  "n_in": ref["n_in"], "n_post": ref["n_post"]}
        rows.append([address(fields[f]) for f in abi.LAYER_FIELDS])
    head = {"h_w": case.head["w"][1], "h_s": case.head["w"][2], "h_norm": case.head["norm"]}
    m, vocab, hidden = len(case.ids), case.embed.shape[0], case.embed.shape[1]
    logits = torch.empty(m, vocab)
    floats = kernel.step_floats(m, hidden, case.inter, case.H, case.Hkv, case.D)
    prefixes = None
    segs = _segments(case.plens)
    if any(any(p) for p in segs):
        width = max(len(p) for p in segs)
        ptab = torch.zeros(m, width, len(case.refs), 2, dtype=torch.int64)
        plens = torch.zeros(m, width, dtype=torch.int64)
        for b, row in enumerate(case.prefixes):
            for s, layers in enumerate(row):
                ptab[b, s] = torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in layers], dtype=torch.int64)
                plens[b, s] = segs[b][s]
        prefixes = (ptab, plens)
    kernel.decode_step(array("q", case.ids + case.positions + case.lengths), case.embed, case.cos, case.sin,
                       case.kind, torch.tensor(rows, dtype=torch.int64),
                       torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in case.caches], dtype=torch.int64),
                       (case.Hkv, case.T, case.D), case.H, case.inter, case.D ** -0.5, eps,
                       torch.tensor([address(head[f]) for f in abi.HEAD_FIELDS], dtype=torch.int64), logits,
                       (torch.empty(m, hidden), torch.empty(floats)), prefixes)
    return logits


def step_error(kernel, case: DecodeCase) -> float:
    """The kernel's step against the reference: the largest difference of logits or caches, relative to the
    logits' scale."""
    want, caches = reference_step(case)
    got = run_step(kernel, case)
    scale = want.abs().max().item() + 1e-6
    diff = (got - want).abs().max().item()
    for (k, v), (k0, v0) in zip(case.caches, caches):
        diff = max(diff, (k - k0).abs().max().item(), (v - v0).abs().max().item())
    return diff / scale


STEP_TOL = 2e-3  # relative to the logits' scale: int8 activations (int16 per block) and bf16 dot products' rounding


def self_check(kernel) -> None:
    """KernelError unless the products and a decode step (batch 1 and five rows, each weight kind, biases and a
    cartridge prefix) match torch."""
    g = torch.Generator().manual_seed(0)
    for name, got, want in product_cases(kernel, g):
        tol = 1e-4 * max(1.0, want.abs().max().item())  # int8: the int16 activations, ~1e-5 of the output's scale
        if not torch.allclose(got, want, rtol=1e-4, atol=tol):
            raise KernelError(f"product {name} differs from torch by {(got - want).abs().max().item():.3g}")
    for kind in (torch.float32, torch.bfloat16, torch.int8):
        for lengths, plens in (([5], [0]), ([0, 15, 3, 7, 1], [0, 3, 0, 2, 0]), ([4, 0], [[3, 5], [0, 2]])):
            err = step_error(kernel, decode_case(g, kind, lengths, plens))
            if err > STEP_TOL:
                raise KernelError(f"a {kind} decode step of {len(lengths)} rows differs from torch by {err:.3g} "
                                  "of the logits' scale")
