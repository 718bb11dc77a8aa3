"""The `match` initialisation: the `select` cartridge's keys, with values fitted so it attends like the document.

A `select` cartridge (final.training.start.select) keeps p of the document's L positions per KV head. A token after it
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
positions.

Before any training it is closer to the document than `select` and than the document's first 8p tokens; fitting
layer by layer to the student's own queries (`sequential`), more conversations or another ridge changed it by a
few per cent at several times the cost (bench/HISTORY.md, "Sixth pass ...: fit the values").
"""

from __future__ import annotations

from typing import Sequence

import torch

from final.training.student import Student

ATTN = "final_match"


class _Stop(Exception):
    """Raised by the recorder after the one layer it fits: the layers above it need not run."""


class _Recorder:
    """An attention function (the model's output unchanged) that adds, for a row read after a `prefix`-token
    cache, each layer's normal equations in the kept positions (`positions` [layers, kv_heads, p], indices into the
    prefix): into gram [layers, kv_heads, p, p] and rhs [layers, kv_heads, p, D]. `layer`: only that layer's (and
    stop the pass after it; -1: none). `targets`: per layer the head outputs to match ([kv_heads, group * T, D]);
    None: the pass's own. `outputs`: a list that gets every layer's head outputs."""

    def __init__(self, model, prefix: int, positions: torch.Tensor):
        cfg = model.config
        self.kvh = cfg.num_key_value_heads
        self.group = cfg.num_attention_heads // self.kvh
        self.D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.prefix, self.positions, p = prefix, positions, positions.shape[-1]
        # the sums live where the positions do: the model's device, so a CUDA pass never copies per layer
        dev = positions.device
        self.gram = torch.zeros(cfg.num_hidden_layers, self.kvh, p, p, dtype=torch.float64, device=dev)
        self.rhs = torch.zeros(cfg.num_hidden_layers, self.kvh, p, self.D, dtype=torch.float64, device=dev)
        self.layer: int | None = None
        self.targets: list[torch.Tensor] | None = None
        self.outputs: list[torch.Tensor] | None = None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        kvh, group, D, layer = self.kvh, self.group, self.D, module.layer_idx
        T, S = query.shape[2], key.shape[2]  # the row's tokens; the prefix and the row
        q = query[0].double().reshape(kvh, group * T, D)  # query head h * group + j serves KV head h
        k, v = key[0].double(), value[0].double()
        scores = q @ k.transpose(1, 2) * (scaling if scaling is not None else D ** -0.5)
        at = torch.arange(T, device=q.device).repeat(group) + (S - T)  # each stacked query's own position
        scores = scores.masked_fill(torch.arange(S, device=q.device)[None, :] > at[:, None], float("-inf"))
        e = (scores - scores.amax(-1, keepdim=True)).exp()
        y = (e @ v) / e.sum(-1, keepdim=True)
        if self.outputs is not None:
            self.outputs.append(y.float())
        if S - T == self.prefix and self.layer in (None, layer):  # not the prefix's own prefill
            self._add(layer, e, v, y if self.targets is None else self.targets[layer].double())
        if self.layer == layer:
            raise _Stop
        out = y.reshape(kvh * group, T, D).transpose(0, 1)[None]  # [1, T, heads, D], as attention functions return
        return out.to(query.dtype).contiguous(), None

    def _add(self, layer: int, e: torch.Tensor, v: torch.Tensor, y: torch.Tensor) -> None:
        P = self.prefix
        rest = e[..., P:] @ v[:, P:]  # M_r O_r
        m_r = e[..., P:].sum(-1, keepdim=True)
        kept = e[..., :P].gather(-1, self.positions[layer][:, None, :].expand(-1, e.shape[1], -1))
        m_c = kept.sum(-1, keepdim=True).clamp_min(1e-300)
        prob = kept / m_c
        target = ((m_c + m_r) * y - rest) / m_c
        weighted = prob * (m_c / (m_c + m_r)) ** 2
        self.gram[layer] += weighted.transpose(1, 2) @ prob
        self.rhs[layer] += weighted.transpose(1, 2) @ target


def solve(gram: torch.Tensor, rhs: torch.Tensor, values: torch.Tensor, frozen: int, ridge: float) -> torch.Tensor:
    """[kv_heads, p, D] fitted values for one layer; the first `frozen` positions keep `values`."""
    g, b, v = gram[:, frozen:, frozen:], rhs[:, frozen:], values.double()
    b = b - gram[:, frozen:, :frozen] @ v[:, :frozen]
    lam = ridge * g.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(1e-30)[:, None, None]
    eye = torch.eye(g.shape[-1], dtype=g.dtype, device=g.device)
    fitted = torch.linalg.solve(g + lam * eye, b + lam * v[:, frozen:])
    return torch.cat([v[:, :frozen], fitted], 1).to(values.dtype)


@torch.no_grad()
def fit_values(student: Student, doc_ids: Sequence[int], rows: Sequence[Sequence[int]],
               positions: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], frozen: int,
               ridge: float = 1e-3, sequential: bool = False) -> list[torch.Tensor]:
    """Per layer [1, kv_heads, p, D]: the kept positions' values (`keys`/`values`: select_kv's) refitted so the
    cartridge's heads give the teacher's outputs on the rows' tokens (each row read after the document).
    `sequential`: layer by layer from the bottom, each fitted to the queries of the cartridge whose lower layers
    are already fitted (the student's own), not to the teacher's; one more pass per layer."""
    from transformers import AttentionInterface, DynamicCache

    model, L, p = student.model, len(doc_ids), keys[0].shape[2]
    teacher = _Recorder(model, L, positions.to(student.device))
    outputs: list[list[torch.Tensor]] = []
    if sequential:
        teacher.layer = -1  # this pass only records the teacher's head outputs
    was = model.config._attn_implementation
    try:
        cache = DynamicCache()
        model(torch.tensor([list(doc_ids)], device=student.device), past_key_values=cache, use_cache=True)
        AttentionInterface.register(ATTN, teacher)
        model.set_attn_implementation(ATTN)
        for row in rows:
            teacher.outputs = [] if sequential else None
            model(torch.tensor([list(row)], device=student.device), past_key_values=cache, use_cache=True)
            outputs.append(teacher.outputs)
            cache.crop(L)
        if not sequential:
            return [_solved(teacher, layer, v, frozen, ridge) for layer, v in enumerate(values)]
        fitted = list(values)
        mine = _Recorder(model, p, torch.arange(p, device=student.device).expand(positions.shape).contiguous())
        AttentionInterface.register(ATTN, mine)
        for layer in range(len(values)):
            mine.layer = layer
            for row, outs in zip(rows, outputs):
                mine.targets = outs
                prefix = DynamicCache([(k.to(student.dtype), v.to(student.dtype)) for k, v in zip(keys, fitted)])
                try:
                    model(torch.tensor([list(row)], device=student.device), past_key_values=prefix, use_cache=True)
                except _Stop:
                    pass
            fitted[layer] = _solved(mine, layer, values[layer], frozen, ridge)
        return fitted
    finally:
        model.set_attn_implementation(was)


def _solved(rec: _Recorder, layer: int, values: torch.Tensor, frozen: int, ridge: float) -> torch.Tensor:
    return solve(rec.gram[layer], rec.rhs[layer], values[0].to(rec.gram.device), frozen, ridge)[None].to(values.device)
