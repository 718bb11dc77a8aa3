"""The `select` initialisation: the cartridge starts as the document's own KV, cut to p positions per KV head.

The `prefix` initialisation (the cartridges repo's) starts from the KV of the document's first p tokens, so
everything after them is missing. Here every KV head keeps the p positions of the *whole* document that it
attends to most while the teacher (the model reading the whole document) reads self-study conversations about it:
the attention probability each position receives, summed over the conversations' tokens and the head's group of
query heads (SnapKV's criterion, with conversations as the observation window). The first `frozen` positions (the
attention sink) are always kept. Each head keeps its own positions, in document order.

Kept keys are post-RoPE at their positions in the document, 0..L-1, while the tokens after a cartridge sit at
p.. . Every kept key is rotated by R_{p-L} (final.cartridges.positions), so a token after the cartridge scores it
exactly as the teacher's token at the same place after the whole document does: (R_{p+m} q)·(R_{p-L} k) =
(R_{L+m} q)·k. Without the rotation the kept keys are ~L positions too close and the cartridge is useless.

Before any training such a start is already as close to the document as 40 steps from its first p tokens get
(bench/HISTORY.md, "Fifth pass ...: start from the document's own KV").
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from final.cartridges.positions import rotate, rotation
from final.errors import CartridgeError
from final.training.student import Student
from final.training.start.match import fit_values


@torch.no_grad()
def attention_mass(student: Student, doc_ids: Sequence[int],
                   rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """[layers, kv_heads, L]: the attention probability each document position gets from the rows' tokens (each
    row read after the whole document), summed over the rows' tokens and each KV head's query heads."""
    from transformers import DynamicCache

    model, L = student.model, len(doc_ids)
    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    mass = torch.zeros(cfg.num_hidden_layers, cfg.num_key_value_heads, L, dtype=torch.float64)
    was = model.config._attn_implementation
    model.set_attn_implementation("eager")  # the only one that returns attention probabilities
    try:
        cache = DynamicCache()
        model(torch.tensor([list(doc_ids)], device=student.device), past_key_values=cache, use_cache=True)
        for row in rows:
            out = model(torch.tensor([list(row)], device=student.device), past_key_values=cache, use_cache=True,
                        output_attentions=True)
            for layer, probs in enumerate(out.attentions):  # [1, heads, T, L + T]
                per_head = probs[0, :, :, :L].sum(1).double().cpu()
                mass[layer] += per_head.view(cfg.num_key_value_heads, group, L).sum(1)
            cache.crop(L)
    finally:
        model.set_attn_implementation(was)
    return mass


def select_positions(mass: torch.Tensor, p: int, frozen: int) -> torch.Tensor:
    """[layers, kv_heads, p] positions, ascending: the first `frozen` and the p - frozen heaviest of the rest."""
    L = mass.shape[-1]
    if not 0 <= frozen < p <= L:
        raise CartridgeError(f"select needs frozen_tokens < tokens <= the document's {L} tokens, got tokens={p}, "
                             f"frozen_tokens={frozen}", field="tokens")
    rest = mass[..., frozen:].topk(p - frozen, dim=-1).indices + frozen
    head = torch.arange(frozen).expand(*mass.shape[:-1], frozen)
    return torch.cat([head, rest], -1).sort(-1).values


def gather_kv(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
              positions: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer [1, kv_heads, p, D]: each head's K/V at its positions (from the document's [1, kv_heads, L, D]),
    the keys still where they were in the document."""
    out_k, out_v = [], []
    for layer, (k, v) in enumerate(zip(keys, values)):
        idx = positions[layer].to(k.device)[None, :, :, None].expand(1, -1, -1, k.shape[-1])
        out_k.append(k.gather(2, idx))
        out_v.append(v.gather(2, idx).contiguous())
    return out_k, out_v


def select_kv(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], positions: torch.Tensor,
              model_dir: str | Path) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """gather_kv, with the kept keys rotated by R_{p-L} so the tokens after the cartridge see them at their
    distance in the document."""
    p, L, head_dim = positions.shape[-1], keys[0].shape[2], keys[0].shape[-1]
    cos, sin = rotation(model_dir, p - L, head_dim, str(model_dir))
    kept_k, kept_v = gather_kv(keys, values, positions)
    return [rotate(k, cos.to(k.device), sin.to(k.device)) for k in kept_k], kept_v


def select_init(student: Student, model_dir: str | Path, doc_ids: Sequence[int],
                rows: Sequence[Sequence[int]], p: int, frozen: int,
                fit: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The `select` initial K/V of a p-token cartridge for the document (its teacher's ids) from observation rows;
    with `fit`, the `match` one (the values refitted on the same rows, final.training.start.match)."""
    if not rows:
        raise CartridgeError("select needs at least one observation conversation", field="init_questions")
    positions = select_positions(attention_mass(student, doc_ids, rows), p, frozen)
    # the K/V come from the student's own (sdpa) forward, not the eager pass above: eager rounds differently
    # (~4e-6), and the cartridge should be exactly the KV the student serves for these positions
    keys, values = select_kv(*student.prefill(doc_ids), positions, model_dir)
    if fit:
        values = fit_values(student, doc_ids, rows, positions, keys, values, frozen)
    return keys, values
