"""The student a cartridge is trained in: the frozen model (`Student`) and the trainable KV prefix (`TrainableKV`).

The model is HF transformers' (autograd, the same weights the engine loads); the prefix is handed to it as a
DynamicCache whose tensors are the trainable parameters, so gradients reach them. One code path for CPU and CUDA:
the model runs in `resolve_dtype(dtype, device)` (fp32 on CPU, bf16 on CUDA for "auto"), the prefix is kept in
fp32 and cast for each forward, and the loss is taken in fp32. Positions: the conversation starts at p, as final
serves a cartridge ("after_prefix"). The training loop over them is final.training.train.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from transformers import AutoModelForCausalLM, DynamicCache

from final.cartridges.format import CartridgeKV
from final.engine.engine import resolve_dtype
from final.training.hidden import layer_states


class Student:
    """The frozen model; `log_probs` runs it after a KV prefix with positions continuing at the prefix length."""

    def __init__(self, model_path: str | Path, device: str = "cpu", dtype: str = "auto"):
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=self.dtype,
                                                          attn_implementation="sdpa").to(self.device).eval()
        self.model.requires_grad_(False)
        self.vocab_size = self.model.config.vocab_size

    @torch.no_grad()
    def prefill(self, ids: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Post-RoPE K/V [1, H_kv, T, D] per layer of `ids` at positions 0..T-1 (a cartridge of the text)."""
        out = self.model(torch.tensor([list(ids)], device=self.device), use_cache=True)
        cache = out.past_key_values
        return ([cache.layers[i].keys.float() for i in range(len(cache.layers))],
                [cache.layers[i].values.float() for i in range(len(cache.layers))])

    def log_probs(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], ids: torch.Tensor,
                  where: torch.Tensor, hidden: bool = False) -> Any:
        """ids [B, T] after the prefix; where [B, T] bool: the positions whose next-token log-probs [N, V] (fp32)
        are returned. `hidden`: (log-probs, every layer's output [N, hidden] at those positions) (states())."""
        states = self.states(keys, values, ids, where, every=hidden)
        logq = F.log_softmax(self.model.lm_head(states[-1]).float(), dim=-1)
        return (logq, states) if hidden else logq

    def states(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], ids: torch.Tensor,
               where: torch.Tensor, every: bool = True) -> list[torch.Tensor]:
        """Each layer's output [N, hidden] at the `where` positions of `ids` read after the prefix (`every`; else the
        last, the final norm's, alone). Right padding needs no mask: causal attention never lets a real token see
        a later pad.

        The rows' common leading tokens before the first target (e.g. the system prompt every tool-use trace
        shares) run once, as one row, and their KV is shared by the batch: exact, and a step costs the shared
        part once instead of B times."""
        B, T = ids.shape
        p = keys[0].shape[2]
        shared = _shared_prefix(ids, where) if B > 1 else 0
        if shared:
            cache = DynamicCache([(k.to(self.dtype), v.to(self.dtype)) for k, v in zip(keys, values)])
            self._run(ids[:1, :shared], cache, p)
            cache = DynamicCache([(layer.keys.expand(B, -1, -1, -1), layer.values.expand(B, -1, -1, -1))
                                  for layer in cache.layers])
        else:
            cache = DynamicCache([(k.to(self.dtype).expand(B, -1, -1, -1), v.to(self.dtype).expand(B, -1, -1, -1))
                                  for k, v in zip(keys, values)])
        at = where[:, shared:]
        return [h[at] for h in self._run(ids[:, shared:], cache, p + shared, every)]

    def _run(self, ids: torch.Tensor, cache: Any, start: int, every: bool = False) -> Any:
        """The decoder over ids [B, T] at positions start.. after `cache` (which it extends); the last hidden
        states, or (`every`) every layer's output, the last being the final norm's (what the logits read)."""
        B, T = ids.shape
        positions = torch.arange(start, start + T, device=self.device)
        out = self.model.model(input_ids=ids, past_key_values=cache, position_ids=positions[None].expand(B, -1),
                               cache_position=positions, use_cache=True, output_hidden_states=every)
        return layer_states(out) if every else [out.last_hidden_state]


def _shared_prefix(ids: torch.Tensor, where: torch.Tensor) -> int:
    """How many leading tokens every row has in common and none of them predicts a target from (0 when fewer
    than 16: not worth a second forward call)."""
    same = (ids == ids[:1]).all(0)
    limit = int(same.logical_not().nonzero()[0]) if not bool(same.all()) else ids.shape[1] - 1
    targets = where.any(0).nonzero()
    if len(targets):
        limit = min(limit, int(targets[0]))
    return limit if limit >= 16 else 0


class TrainableKV(nn.Module):
    """The cartridges repo's TrainableCache layout: frozen_* and trainable_* ParameterLists, one tensor a layer."""

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], frozen_tokens: int):
        super().__init__()
        f = frozen_tokens

        def plist(ts: Sequence[torch.Tensor], lo: int, hi: int | None, grad: bool) -> nn.ParameterList:
            return nn.ParameterList([nn.Parameter(t[:, :, lo:hi].detach().float().clone(), requires_grad=grad)
                                     for t in ts])

        self.frozen_keys, self.frozen_values = plist(keys, 0, f, False), plist(values, 0, f, False)
        self.trainable_keys, self.trainable_values = plist(keys, f, None, True), plist(values, f, None, True)
        self.frozen_tokens = f

    def full(self, beside: tuple | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The whole KV; with `beside` (Batch.beside: a partner's keys, values and whether it goes in front), the
        two as a request composing them is served, [partner, us] or [us, partner]."""
        cat = lambda a, b: [torch.cat([x, y], dim=2) for x, y in zip(a, b)]  # noqa: E731
        keys, values = cat(self.frozen_keys, self.trainable_keys), cat(self.frozen_values, self.trainable_values)
        if beside is None:
            return keys, values
        pk, pv, front = beside
        return (cat(pk, keys), cat(pv, values)) if front else (cat(keys, pk), cat(values, pv))

    def span(self, beside: tuple | None = None) -> tuple[int, int]:
        """Where the trainable positions sit among full(beside)'s keys: after the partner when it is in front."""
        start = (beside[0][0].shape[2] if beside is not None and beside[2] else 0) + self.frozen_tokens
        return start, start + self.trainable_keys[0].shape[2]

    def cartridge(self, dtype: torch.dtype = torch.float32) -> CartridgeKV:
        keys, values = self.full()
        return CartridgeKV([k.detach().to("cpu", dtype) for k in keys], [v.detach().to("cpu", dtype) for v in values],
                           self.frozen_tokens)
