"""Batched next-token choice with SGLang 0.5.2's semantics.

Greedy rows take the argmax. Sampled rows use softmax(logits / temperature) filtered by top-k, top-p and min-p
exactly as SGLang's torch fallback (`top_k_top_p_min_p_sampling_from_probs_torch`), then draw with the row's own
torch.Generator (on the CPU, whatever the device), so a request with a seed gets the same tokens whatever else is
in the batch. Logprobs are SGLang's: log of the temperature-scaled probabilities before filtering (plain
log_softmax for greedy rows), and a row's top-k alternatives (top_logprobs_num) come from the same distribution.
A constrained row (json_schema, regex, ebnf, structural_tag) has the tokens its grammar does not allow set to -inf
after the penalties and before everything else, as SGLang applies its vocab mask: its logprobs are those of the
masked distribution, and greedy rows take the argmax of the masked logits.
"""

from __future__ import annotations

import torch

from final.engine.grammar import mask_logits
from final.engine.sequence import Sequence


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Presence/frequency penalties over output tokens, repetition penalty over prompt+output (in place)."""
    for row, seq in enumerate(seqs):
        p = seq.params
        if not p.has_penalties:
            continue
        if seq.output_ids and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(seq.output_ids), minlength=logits.shape[1]).to(logits)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.prompt_ids) | set(seq.output_ids)), device=logits.device)
            vals = logits[row, seen]
            logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)


def block_early_stop(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """min_new_tokens: stop tokens cannot be chosen before the minimum is reached (in place)."""
    for row, seq in enumerate(seqs):
        if len(seq.output_ids) < seq.params.min_new_tokens and seq.stop_ids:
            logits[row, list(seq.stop_ids)] = float("-inf")


def _filtered_draw(probs: torch.Tensor, seq: Sequence) -> int:
    p = seq.params
    if p.top_k == -1 and p.top_p >= 1.0 and p.min_p <= 0.0:
        return int(torch.multinomial(probs, 1, generator=seq.generator))
    probs_sort, probs_idx = probs.sort(descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    if p.top_k != -1:
        probs_sort[p.top_k:] = 0.0
    probs_sort[(probs_sum - probs_sort) > p.top_p] = 0.0
    if p.min_p > 0:
        probs_sort[probs_sort < probs_sort[0] * p.min_p] = 0.0
    return int(probs_idx[torch.multinomial(probs_sort, 1, generator=seq.generator)])


def top_k(logprobs: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    """The k most likely tokens of each row of logprobs [N,V]: (logprob, token id), most likely first."""
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return [list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]


def sample(logits: torch.Tensor, seqs: list[Sequence]
           ) -> tuple[list[int], list[float] | None, list[list[tuple[float, int]] | None] | None]:
    """logits [B,V] (fp32, or the model dtype; may be modified in place) -> one token per row, and logprobs and
    top-k alternatives if any row asked for them."""
    want_logprobs = any(s.return_logprob for s in seqs)
    greedy = [s.params.greedy for s in seqs]
    constrained = any(s.grammar is not None for s in seqs)
    plain = all(greedy) and not want_logprobs and not constrained and not any(
        s.params.has_penalties or len(s.output_ids) < s.params.min_new_tokens for s in seqs)
    if plain:  # argmax is unchanged by the (exact) bf16 -> fp32 upcast, so skip the [B,V] copy
        return logits.max(dim=-1).indices.tolist(), None, None
    logits = logits.float()
    apply_penalties(logits, seqs)
    if constrained:
        mask_logits(logits, [s.grammar for s in seqs], [s.stop_ids for s in seqs])
    block_early_stop(logits, seqs)
    if all(greedy):
        tokens = logits.max(dim=-1).indices  # argmax's first-maximum rule at a third of its cost on CPU
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if logprobs is not None and constrained:  # masked tokens: the dtype's lowest finite value, not -inf
            logprobs = logprobs.clamp(min=torch.finfo(logprobs.dtype).min)
    else:
        temps = torch.tensor([1.0 if g else s.params.temperature for g, s in zip(greedy, seqs)],
                             dtype=logits.dtype, device=logits.device)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        tokens = probs.argmax(dim=-1)
        # each row draws with its own CPU generator (a seed gives one stream on every device): on a GPU the
        # sampled rows' probabilities come over once, not row by row (torch refuses a CPU generator for CUDA data)
        sampled = [row for row, g in enumerate(greedy) if not g]
        host = probs[sampled].cpu() if probs.device.type != "cpu" else None
        for i, row in enumerate(sampled):
            tokens[row] = _filtered_draw(host[i] if host is not None else probs[row], seqs[row])
        logprobs = torch.log(probs).clamp(min=torch.finfo(probs.dtype).min) if want_logprobs else None
    token_list = tokens.tolist()
    if logprobs is None:
        return token_list, None, None
    tops = None
    if any(s.top_logprobs_num for s in seqs):
        tops = [top_k(logprobs[row:row + 1], s.top_logprobs_num)[0] if s.top_logprobs_num else None
                for row, s in enumerate(seqs)]
    return token_list, logprobs.gather(1, tokens[:, None]).squeeze(1).tolist(), tops
