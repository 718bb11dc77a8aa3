"""The `match` initialisation: the `select` cartridge's keys, with values fitted so it attends like the document.

A `select` cartridge (final.distill.select) keeps p of the document's L positions per KV head. A token after it
then misses the rest: the kept positions' softmax is renormalised without them, and the tokens after the cartridge
(the question, the answer so far) get the attention mass the dropped positions had. Keys fixed, both errors can be
undone in the values by least squares, since a head's output is linear in them (attention matching, as in
Zweiger et al., "Fast KV compaction via attention matching", 2026, without their per-key bias, which no backend
serving a cartridge can apply).

For a query q (the teacher's, from self-study conversations read after the whole document), with masses M_d (its
unnormalised attention on the document), M_c (on the kept positions) and M_r (on the tokens after the document),
and outputs y (the teacher's head output), O_r (over the tokens after), P (its attention over the kept positions):
the cartridge gives (M_c P W + M_r O_r) / (M_c + M_r) for values W. That equals y where
P W = ((M_c + M_r) y - M_r O_r) / M_c, an error there being scaled by w = M_c / (M_c + M_r) in the output. So
W = argmin sum_q w^2 |P W - target|^2 + lambda |W - V|^2 (V: the kept positions' own values, lambda = `ridge`
times the mean diagonal of the normal matrix), per layer and KV head, over the query heads of its group. Each
layer is fitted to the teacher's queries at that layer. The frozen positions (the sink) keep their values.

Keys are unchanged, and (R_{p+m} q)·(R_{p-L} k) = (R_{L+m} q)·k (select.py), so the fit is exact in the teacher's
positions. Measured in bench/RESULTS.md.
"""

from __future__ import annotations

from typing import Sequence

import torch

ATTN = "final_match"


def _statistics(model, L: int, positions: torch.Tensor):
    """The attention function that records each layer's normal equations (the model's output unchanged), and the
    [layers, kv_heads, p, p] / [layers, kv_heads, p, D] sums it fills."""
    cfg = model.config
    kvh = cfg.num_key_value_heads
    group = cfg.num_attention_heads // kvh
    p, D = positions.shape[-1], getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gram = torch.zeros(cfg.num_hidden_layers, kvh, p, p, dtype=torch.float64)
    rhs = torch.zeros(cfg.num_hidden_layers, kvh, p, D, dtype=torch.float64)

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        T, S = query.shape[2], key.shape[2]  # the row's tokens; the document and the row
        q = query[0].double().reshape(kvh, group * T, D)  # query head h * group + j serves KV head h
        k, v = key[0].double(), value[0].double()
        scores = q @ k.transpose(1, 2) * (scaling if scaling is not None else D ** -0.5)
        at = torch.arange(T).repeat(group) + (S - T)  # each stacked query's own position
        scores = scores.masked_fill(torch.arange(S)[None, :] > at[:, None], float("-inf"))
        e = (scores - scores.amax(-1, keepdim=True)).exp()
        total = e.sum(-1, keepdim=True)
        y = (e @ v) / total
        if S - T == L:  # a row read after the document: accumulate (the document's own prefill is not)
            rest = e[..., L:] @ v[:, L:]  # M_r O_r
            m_r = e[..., L:].sum(-1, keepdim=True)
            idx = positions[module.layer_idx][:, None, :].expand(-1, group * T, -1)
            kept = e[..., :L].gather(-1, idx)
            m_c = kept.sum(-1, keepdim=True).clamp_min(1e-300)
            prob = kept / m_c
            target = ((m_c + m_r) * y - rest) / m_c
            weighted = prob * (m_c / (m_c + m_r)) ** 2
            gram[module.layer_idx] += weighted.transpose(1, 2) @ prob
            rhs[module.layer_idx] += weighted.transpose(1, 2) @ target
        out = y.reshape(kvh * group, T, D).transpose(0, 1)[None]  # [1, T, heads, D], as attention functions return
        return out.to(query.dtype).contiguous(), None

    return attend, gram, rhs


def solve(gram: torch.Tensor, rhs: torch.Tensor, values: torch.Tensor, frozen: int, ridge: float) -> torch.Tensor:
    """[kv_heads, p, D] fitted values for one layer; the first `frozen` positions keep `values`."""
    g, b, v = gram[:, frozen:, frozen:], rhs[:, frozen:], values.double()
    b = b - gram[:, frozen:, :frozen] @ v[:, :frozen]
    lam = ridge * g.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(1e-30)[:, None, None]
    eye = torch.eye(g.shape[-1], dtype=g.dtype)
    fitted = torch.linalg.solve(g + lam * eye, b + lam * v[:, frozen:])
    return torch.cat([v[:, :frozen], fitted], 1).to(values.dtype)


@torch.no_grad()
def fit_values(student: "Student", doc_ids: Sequence[int], rows: Sequence[Sequence[int]],  # noqa: F821
               positions: torch.Tensor, values: Sequence[torch.Tensor], frozen: int,
               ridge: float = 1e-3) -> list[torch.Tensor]:
    """Per layer [1, kv_heads, p, D]: the kept positions' values (`values`, as gather_kv gives them) refitted so
    the cartridge's heads give the teacher's outputs on the rows' tokens (each row read after the document)."""
    from transformers import AttentionInterface, DynamicCache

    model, L = student.model, len(doc_ids)
    attend, gram, rhs = _statistics(model, L, positions.cpu())
    AttentionInterface.register(ATTN, attend)
    was = model.config._attn_implementation
    try:
        cache = DynamicCache()
        model(torch.tensor([list(doc_ids)], device=student.device), past_key_values=cache, use_cache=True)
        model.set_attn_implementation(ATTN)
        for row in rows:
            model(torch.tensor([list(row)], device=student.device), past_key_values=cache, use_cache=True)
            cache.crop(L)
    finally:
        model.set_attn_implementation(was)
    return [solve(gram[layer], rhs[layer], v[0].cpu(), frozen, ridge)[None].to(v.device)
            for layer, v in enumerate(values)]
