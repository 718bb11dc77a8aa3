"""Attention for one forward pass: write K/V into the row cache, attend, and fold in prefix segments.

A row with a cartridge or a cached prefix attends to its prefix segments - the cartridge's K/V (positions
0..p-1, shared by every row that uses it), then the prefix cache's nodes it attached to (final/engine/
prefix_cache.py) - and its own tokens. Each segment is attended separately and the results are merged exactly
with their log-sum-exp, so a prefix is read once per step for a whole group of rows and never copied per row; the
engine's kernel does the same in one softmax (kernels/attention.h). Rows without any take PyTorch's fused SDPA.

Layouts: q [B,T,H,D] and k/v [B,T,Hkv,D] as the model produces them; grouped-query attention is computed
as [B,Hkv,G*T,D] so K/V are never repeated per query head.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from final.engine.kernels import gemv_kernel
from final.engine.kv_cache import KVCache, PrefixKV

_QUERY_CHUNK = 256  # bounds the fp32 score matrix of long prompts in the merged path


def flash_attn_for(device: torch.device, dtype: torch.dtype) -> Any:
    """The flash_attn module (extra [gpu]) where it applies: CUDA, fp16/bf16. None means PyTorch SDPA."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        import flash_attn
    except ImportError:
        return None
    return flash_attn


def group_q(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B,T,H,D] -> [B,Hkv,G,T,D] (query head h uses kv head h // G, as HF's repeat_kv)."""
    B, T, H, D = q.shape
    return q.view(B, T, num_kv_heads, H // num_kv_heads, D).permute(0, 2, 3, 1, 4)


def ungroup_o(o: torch.Tensor) -> torch.Tensor:
    """[B,Hkv,G,T,D] -> [B,T,H,D]."""
    B, Hkv, G, T, D = o.shape
    return o.permute(0, 3, 1, 2, 4).reshape(B, T, Hkv * G, D)


def attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns the log-sum-exp of the scores.

    q [..., M, D], k/v [..., N, D], mask broadcastable to [..., M, N] (True = attend). Returns o [..., M, D]
    in q's dtype and lse [..., M] in fp32 (-inf where a query sees nothing in this segment).
    """
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min))
    p = torch.nan_to_num(p, nan=0.0)
    return torch.matmul(p.to(v.dtype), v), lse


# PyTorch's CPU flash kernel also returns the log-sum-exp; it reads K/V once in blocks, where attend_lse makes
# several full passes over an fp32 score matrix (5x slower for a 7k-token cartridge in fp32, 10x in bf16).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _flash_cpu_applies(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and _FLASH_CPU is not None and q.dtype in (torch.float32, torch.bfloat16)


def merge_lse(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention results over disjoint key chunks stacked on dim 0: o [c,...,M,D], lse [c,...,M]."""
    m = lse.amax(dim=0)
    w = torch.exp(lse - m)
    total = w.sum(dim=0)
    out = (o.float() * w.unsqueeze(-1)).sum(dim=0) / total.unsqueeze(-1)
    return out.to(o.dtype), m + torch.log(total)


_MIN_CHUNK = 256  # keys per chunk below which splitting a prefix costs more than it balances


def _flash_prefix(flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """flat [Hkv,M,D] against k/v [Hkv,p,D] with the CPU flash kernel, the keys split into one chunk per thread.

    The kernel parallelises over (batch, head, query block) only: 3 kv heads and a short question give 3 tasks
    for 2 threads. Chunks of keys as a batch axis balance them (views of the K/V, not copies) and the chunks
    merge exactly by log-sum-exp: 50 -> 39 ms for a 7k-token cartridge over 30 layers (bench/RESULTS.md, P2).
    """
    Hkv, p, D = k.shape
    c = max(1, min(torch.get_num_threads(), p // _MIN_CHUNK))
    if c == 1:
        o, lse = _FLASH_CPU(flat[None], k[None], v[None], scale=scale)
        return o[0], lse[0]
    w = p // c
    ks = k[:, : w * c].reshape(Hkv, c, w, D).transpose(0, 1)
    vs = v[:, : w * c].reshape(Hkv, c, w, D).transpose(0, 1)
    o, lse = _FLASH_CPU(flat[None].expand(c, -1, -1, -1), ks, vs, scale=scale)
    if w * c < p:  # the last p % c keys
        o_t, lse_t = _FLASH_CPU(flat[None], k[None, :, w * c:], v[None, :, w * c:], scale=scale)
        o, lse = torch.cat([o, o_t]), torch.cat([lse, lse_t])
    return merge_lse(o, lse)


def attend_kv(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' grouped queries [n,Hkv,G,T,D] against one shared segment k/v [Hkv,p,D]: one pass for all rows.
    Returns o [n,Hkv,G,T,D] and its lse [n,Hkv,G,T]."""
    n, Hkv, G, T, D = qg.shape
    flat = qg.permute(1, 0, 2, 3, 4).reshape(Hkv, n * G * T, D)
    kernel = gemv_kernel() if flat.dtype == torch.float32 and flat.device.type == "cpu" else None
    if kernel is not None and k.stride()[1:] == (D, 1) and k.stride() == v.stride():
        o, lse = kernel.prefix_attend(flat.contiguous(), k, v, scale)  # blocked over heads, queries and keys
    elif _flash_cpu_applies(flat):  # kv heads as heads, every row's queries of a group along the query axis
        o, lse = _flash_prefix(flat, k, v, scale)
    else:
        o, lse = attend_lse(flat, k, v, scale)
    o = o.reshape(Hkv, n, G, T, D).permute(1, 0, 2, 3, 4)
    return o, lse.view(Hkv, n, G, T).permute(1, 0, 2, 3)


def attend_prefix(qg: torch.Tensor, prefix: PrefixKV, layer: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """attend_kv over a prefix's (a cartridge's) layer."""
    return attend_kv(qg, prefix.k[layer], prefix.v[layer], scale)


@dataclass(frozen=True)
class SlotSpan:
    """A row's first `length` tokens in its own slot, attended as a prefix segment: a cached prefix copied into the
    slot (where decode cannot read segments), before the prefill of the rest."""

    slot: int
    length: int


def merge_segments(o: torch.Tensor, lse: torch.Tensor, qg: torch.Tensor, segments: tuple, layer: int, scale: float,
                   cache: KVCache) -> torch.Tensor:
    """Attention over the own tokens (o, lse) and each prefix segment of qg's rows, merged by log-sum-exp."""
    outs, lses = [o], [lse]
    for seg in segments:
        if isinstance(seg, SlotSpan):
            k, v = cache.k[layer][seg.slot, :, : seg.length], cache.v[layer][seg.slot, :, : seg.length]
        else:
            k, v = seg.k[layer], seg.v[layer]
        o_seg, lse_seg = attend_kv(qg, k, v, scale)
        outs.append(o_seg)
        lses.append(lse_seg)
    return merge_lse(torch.stack(outs), torch.stack(lses))[0]


def causal_lse(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal self-attention with lse, chunked over queries. qg [n,Hkv,G,T,D], k/v [n,Hkv,T,D]."""
    n, Hkv, G, T, D = qg.shape
    if _flash_cpu_applies(qg):  # the kernel has no GQA: repeat the rows' own K/V per query head (small)
        o, lse = _FLASH_CPU(qg.reshape(n, Hkv * G, T, D), k.repeat_interleave(G, dim=1),
                            v.repeat_interleave(G, dim=1), is_causal=True, scale=scale)
        return o.reshape(n, Hkv, G, T, D), lse.reshape(n, Hkv, G, T)
    outs, lses = [], []
    idx = torch.arange(T, device=qg.device)
    for t0 in range(0, T, _QUERY_CHUNK):
        t1 = min(T, t0 + _QUERY_CHUNK)
        mask = idx[None, :t1] <= idx[t0:t1, None]  # [c, t1]
        qc = qg[:, :, :, t0:t1].reshape(n, Hkv, G * (t1 - t0), D)
        o, lse = attend_lse(qc, k[:, :, :t1], v[:, :, :t1], scale, mask.repeat(G, 1))
        outs.append(o.view(n, Hkv, G, t1 - t0, D))
        lses.append(lse.view(n, Hkv, G, t1 - t0))
    return torch.cat(outs, dim=3), torch.cat(lses, dim=3)


@dataclass
class PrefillPlan:
    """New rows, right-padded to a common length T, each after its prefix segments (`prefix` for all of them, or
    `segments` per row: a cartridge, cached prefix nodes, SlotSpans) and written into its slot from `offsets`."""

    cache: KVCache
    slots: list[int]
    prefix: PrefixKV | None
    scale: float
    capture: bool = False  # keep each layer's K/V (used to build cartridges from text)
    flash: Any = None  # flash_attn module (CUDA, extra [gpu]) or None for SDPA
    offsets: list[int] | None = None  # per row, where its new tokens go in its slot (0: from the start)
    segments: list[tuple] | None = None  # per row, the prefix segments its new tokens attend to first

    fuses_layers = False  # whole layers in one kernel call: decode only (DecodePlan)
    prefixes = None

    def __post_init__(self) -> None:
        self.captured: list[tuple[torch.Tensor, torch.Tensor]] = []
        n = len(self.slots)
        self.offsets = self.offsets or [0] * n
        if self.segments is None:
            self.segments = [(self.prefix,) if self.prefix is not None else ()] * n
        lo, hi = self.slots[0], self.slots[0] + n
        # New rows take consecutive slots (the scheduler appends them): then one slice write per layer.
        self.slot_range = (lo, hi) if self.slots == list(range(lo, hi)) and not any(self.offsets) else None
        groups: dict[tuple, tuple[list[int], tuple]] = {}
        for row, segs in enumerate(self.segments):
            if segs:
                groups.setdefault(tuple(map(id, segs)), ([], segs))[0].append(row)
        # rows that share their segments attend to them in one pass (None: every row of the batch)
        self.groups = [(None if len(rows) == n else torch.tensor(rows), segs) for rows, segs in groups.values()]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T = q.shape[1]
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [n,Hkv,T,D]
        if self.capture:
            self.captured.append((kt.detach().clone(), vt.detach().clone()))
        if self.slot_range is not None:
            lo, hi = self.slot_range
            self.cache.k[layer][lo:hi, :, :T] = kt
            self.cache.v[layer][lo:hi, :, :T] = vt
        else:
            for row, (slot, at) in enumerate(zip(self.slots, self.offsets)):
                self.cache.k[layer][slot, :, at:at + T] = kt[row]
                self.cache.v[layer][slot, :, at:at + T] = vt[row]
        if not self.groups and self.flash is not None:
            return self.flash.flash_attn_func(q, k, v, softmax_scale=self.scale, causal=True)
        if not self.groups:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kt, vt, is_causal=True, scale=self.scale,
                                               enable_gqa=True)
            return o.transpose(1, 2)
        qg = group_q(q, k.shape[2])
        o, lse = causal_lse(qg, kt, vt, self.scale)
        for rows, segs in self.groups:
            if rows is None:
                o = merge_segments(o, lse, qg, segs, layer, self.scale, self.cache)
            else:
                o[rows] = merge_segments(o[rows], lse[rows], qg[rows], segs, layer, self.scale, self.cache)
        return ungroup_o(o)


@dataclass
class DecodePlan:
    """One new token for each running row; row i is slot i and has `lengths[i]` tokens cached already.

    `step` holds the rows' token ids, positions and cached lengths as one int64 array [3 B]: the kernel's whole-step
    call reads it where it lies, and the tensors below are made only for the torch path (each torch op of a step
    runs cold, after the weights have streamed through the caches: ~20-70 us)."""

    cache: KVCache
    step: array  # 'q': B token ids, B positions, B cached lengths
    groups: list[tuple[torch.Tensor, Any]]  # (row indices, their shared prefix segments: a PrefixKV or a tuple)
    scale: float
    flash: Any = None  # flash_attn module (CUDA, extra [gpu]) or None for SDPA
    table: tuple[torch.Tensor, torch.Tensor] | None = None  # the rows' segments as the kernel reads them (runner)
    kernel: Any = None  # the engine's C kernel: the torch path's fp32 rows with segments attend on it

    @cached_property
    def rows(self) -> torch.Tensor:
        """step as a [3, B] tensor on the cache's device."""
        return torch.frombuffer(self.step, dtype=torch.int64).view(3, self.batch).to(self.cache.device)

    @cached_property
    def lengths(self) -> torch.Tensor:  # [B] long
        return self.rows[2]

    @property
    def fuses_layers(self) -> bool:
        """The C kernel's whole-layer decode attends like the fp32 CPU path below, cartridge prefixes too
        (`prefixes`); it needs none of the other tensors below, so they are built on attend's first call (~10 torch
        ops a step)."""
        return self.fp32_cpu

    def __post_init__(self) -> None:
        self.fp32_cpu = self.cache.dtype == torch.float32 and self.cache.device.type == "cpu"
        self.batch = len(self.step) // 3
        self.groups = [(rows, segs if isinstance(segs, tuple) else (segs,)) for rows, segs in self.groups]

    @cached_property
    def prefixes(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kernel's view of the rows' prefix segments: [B, S, layers, 2] K/V addresses and [B, S] lengths (0:
        none), the runner's table or made here from the groups."""
        if not self.groups or self.table is not None:
            return self.table if self.groups else None
        B, layers, width = self.batch, len(self.cache.k), max(len(segs) for _, segs in self.groups)
        table, lengths = torch.zeros(B, width, layers, 2, dtype=torch.int64), torch.zeros(B, width, dtype=torch.int64)
        for rows, segs in self.groups:
            for i, seg in enumerate(segs):
                table[rows, i] = seg.addresses()
                lengths[rows, i] = seg.length
        return table, lengths

    @cached_property
    def row_index(self) -> torch.Tensor:
        return torch.arange(self.batch, device=self.lengths.device)

    @cached_property
    def span(self) -> int:
        return int(self.lengths.max()) + 1

    @cached_property
    def mask(self) -> torch.Tensor:
        return torch.arange(self.span, device=self.lengths.device)[None, :] <= self.lengths[:, None]

    @cached_property
    def seqlens(self) -> torch.Tensor | None:
        return (self.lengths + 1).to(torch.int32) if self.flash is not None else None

    @cached_property
    def bias(self) -> torch.Tensor | None:
        """fp32 on CPU: two matmuls and a softmax beat SDPA's flash kernel for one query per row (43 vs 56 us a
        layer at batch 8, bench/RESULTS.md) and agree to fp32 rounding. bf16 keeps SDPA, whose rounding HF
        shares."""
        if not self.fp32_cpu:
            return None
        bias = torch.zeros(self.mask.shape, device=self.lengths.device).masked_fill(~self.mask, float("-inf"))
        return bias[:, None, None, :]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B = q.shape[0]
        ck, cv = self.cache.k[layer], self.cache.v[layer]
        ck[self.row_index, :, self.lengths] = k[:, 0]
        cv[self.row_index, :, self.lengths] = v[:, 0]
        if not self.groups and self.flash is not None:  # reads the slot cache in place: [S,T,Hkv,D] strides
            return self.flash.flash_attn_with_kvcache(q, ck.transpose(1, 2), cv.transpose(1, 2),
                                                      cache_seqlens=self.seqlens, softmax_scale=self.scale,
                                                      causal=True)
        if self.kernel is not None and self.fp32_cpu:  # the whole-step call's attention, prefix segments included
            out = self.kernel.attend(q[:, 0].contiguous(), ck, cv, self.lengths, self.prefixes, layer, self.scale)
            return out.view(B, 1, q.shape[2], q.shape[3])
        keys, values = ck[:B, :, : self.span], cv[:B, :, : self.span]
        if not self.groups and self.bias is not None:
            qg = q[:, 0].reshape(B, k.shape[2], -1, q.shape[-1])  # [B,Hkv,G,D]
            s = torch.matmul(qg, keys.transpose(-1, -2)) * self.scale + self.bias
            return torch.matmul(torch.softmax(s, dim=-1), values).reshape(B, 1, -1, q.shape[-1])
        if not self.groups:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=self.mask[:, None, None, :],
                                               scale=self.scale, enable_gqa=True)
            return o.transpose(1, 2)
        qg = group_q(q, k.shape[2])  # [B,Hkv,G,1,D]
        Hkv, G, D = qg.shape[1], qg.shape[2], qg.shape[4]
        o, lse = attend_lse(qg.reshape(B, Hkv, G, D), keys, values, self.scale, self.mask[:, None, None, :])
        o, lse = o.unsqueeze(3), lse.unsqueeze(3)
        for rows, segs in self.groups:
            o[rows] = merge_segments(o[rows], lse[rows], qg[rows], segs, layer, self.scale, self.cache)
        return ungroup_o(o)
