"""Quiet beside a neighbour (`learn --quiet-partner W`): how loud the trained KV is to another document's questions.

Served beside another cartridge, a trained one loses a third of its answers (bench/RESULTS.md, issue 42). Measured
(experiments/cartridge_loudness.py), the cause is the neighbour's *loudness*: its part of each layer's attention output,
sum_j a_j v_j over its positions, for questions that are not about it. A document in context beside another is
quiet there (0.24, brennock's questions beside kestrel's text); a trained cartridge is three times as loud (0.68-0.72,
whatever its start), and scaling the neighbour's values down brings the questions' answers back (0.43 -> 0.52, the
same as alone) while it silences the neighbour's own. So at the steps beside a partner, the partner's own rows
(final/distill/keep.py) are read after both caches and the mean loudness of our positions (the frozen first one,
every cartridge's attention sink, apart) is added to the loss at weight W: loud for our questions, quiet for others'.

The loudness is recomputed beside the model's own attention, from each layer's queries (its q_proj, q_norm where it
has one, RoPE) and the cache the layer has just extended, so the forward pass itself is the model's unchanged.

Measured (bench/RESULTS.md): the term quiets the cartridge to another document's questions down to a document's
level, and to its own questions with it, so composed it answers no more. `by="mass"` (the attention our keys get)
halves own and foreign alike. `by="ratio"` (distill_loss: that loudness over our loudness to our own rows) tells
them apart - own/other 1.3-1.4, a document's - and kept 0.83x / 1.00x composed on the tune halves, 0.64x on the
held-out pair. All opt-in, not the default.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator

import torch


# what --quiet-partner trains down: the loudness to the partner's rows; the attention mass they give our keys; or
# the loudness to them over the loudness to our own rows (scale-free: smaller values alone do not lower it)
MEASURES = ("loudness", "mass", "ratio")


class Loudness:
    """Collects, per attention layer called, the loudness of keys [start, end) at the query positions `where`
    (by="mass": the attention mass they get instead)."""

    def __init__(self, start: int, end: int, where: torch.Tensor, by: str = "loudness"):
        self.start, self.end, self.where, self.by = start, end, where, by
        self.layers: list[torch.Tensor] = []

    def hook(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cache = kwargs.get("past_key_values", kwargs.get("past_key_value"))
        layer = cache.layers[module.layer_idx]
        self.layers.append(loudness(_queries(module, hidden, kwargs["position_embeddings"]), layer.keys,
                                    layer.values, module.scaling, self.start, self.end, self.by)[self.where])

    def mean(self) -> torch.Tensor:
        """The mean over layers and query positions (what the loss adds)."""
        return torch.stack([x.mean() for x in self.layers]).mean()


def _queries(module: Any, hidden: torch.Tensor, position_embeddings: tuple) -> torch.Tensor:
    """The layer's post-RoPE queries [B, H, T, D], as its forward computed them (Llama / Qwen-style attention)."""
    B, T, _ = hidden.shape
    q = module.q_proj(hidden).view(B, T, -1, module.head_dim)
    norm = getattr(module, "q_norm", None)  # Qwen3 normalises each head's query before RoPE; Llama does not
    q = (norm(q) if norm is not None else q).transpose(1, 2)
    cos, sin = position_embeddings
    rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
    return rope(q, q, cos, sin)[0]


def loudness(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, start: int,
             end: int, by: str = "loudness") -> torch.Tensor:
    """||sum_{j in [start, end)} a_ij v_j|| per query [B, T], the mean over heads, where a is causal softmax
    attention of queries q [B, H, T, D] (the last T positions) over keys k, v [B, H_kv, K, D]; the span lies
    before the queries (a cached prefix), so every query sees all of it. by="mass": sum_j a_ij instead: no value
    enters it but through the queries of the layers after its own, so it does not pay to shrink what the span says to
    the questions that do read it (what the loudness term does, measured: bench/RESULTS.md)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    logits = (q @ k.transpose(-1, -2)).float() * scaling
    T, K = q.shape[2], k.shape[2]
    seen = torch.arange(K, device=q.device)[None, :] <= torch.arange(K - T, K, device=q.device)[:, None]
    lse = logits.masked_fill(~seen, float("-inf")).logsumexp(-1, keepdim=True)
    if by == "mass":
        return torch.exp(logits[..., start:end] - lse).sum(-1).mean(1)
    part = torch.exp(logits[..., start:end] - lse) @ v[:, :, start:end].float()
    return part.norm(dim=-1).mean(1)


@contextmanager
def measured(model: Any, start: int, end: int, where: torch.Tensor, by: str = "loudness") -> Iterator[Loudness]:
    """Within the block, every attention layer of `model` (a transformers causal LM) adds its loudness (or mass,
    `by`) of keys [start, end) at `where` to the yielded Loudness."""
    got = Loudness(start, end, where, by)
    handles = [layer.self_attn.register_forward_hook(got.hook, with_kwargs=True) for layer in model.model.layers]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()
