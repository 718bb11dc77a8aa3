"""Distillation losses on a cartridge's student, per target token, and the KL each reports.

`forward_topk` is the cartridges repo's loss (`train.py`, loss_type="logits") and veRL 0.9's `forward_kl_topk`:
-sum_k p_teacher(k) log q_student(k) over the teacher's top-k ids, not renormalised. Its value includes the
teacher's entropy over those k, so the KL reported beside it is that cross-entropy minus the teacher's top-k
entropy, sum_k p (log p - log q): 0 when the student equals the teacher on the top-k, and below 0 when the
student moves the tail's mass onto them. `forward_topk_tail` adds the rest of the vocabulary as one bucket,
which makes it a true KL (>= 0; validation judges by it, and the on-policy loop trains on it: RESULTS,
"On-policy distillation").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from final.training.hidden import hidden_error

LOSSES = ("forward_topk", "forward_topk_tail")


@dataclass
class Targets:
    """What the teacher said at N target positions (in row order): its top-k ids and their logprobs."""
    top_ids: torch.Tensor  # [N, k]
    top_logprobs: torch.Tensor  # [N, k]


def forward_topk(logq: torch.Tensor, t: Targets) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (loss, KL) of the top-k forward KL; logq [N, V] the student's log-probs."""
    p = t.top_logprobs.exp()
    ce = -(p * logq.gather(1, t.top_ids)).sum(-1)
    entropy = -(p * t.top_logprobs).sum(-1)
    return ce, (ce - entropy).detach()


def forward_topk_tail(logq: torch.Tensor, t: Targets) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (loss, KL) of the forward KL between the two distributions coarsened to the teacher's top-k ids
    plus one bucket for every other token: sum_k p (log p - log q) + p_rest (log p_rest - log q_rest). A true KL
    (>= 0, a lower bound of the full one), unlike forward_topk's: a student that moves the tail's mass onto the
    top-k lowers forward_topk's KL below 0 while the full KL grows, and here pays for it."""
    lq = logq.gather(1, t.top_ids)
    lp = t.top_logprobs
    p = lp.exp()
    lp_rest = torch.log1p(-p.sum(-1).clamp(max=1 - 1e-6))
    lq_rest = torch.log1p(-lq.exp().sum(-1).clamp(max=1 - 1e-6))
    kl = (p * (lp - lq)).sum(-1) + lp_rest.exp() * (lp_rest - lq_rest)
    return kl, kl.detach()


@dataclass
class StepLoss:
    loss: torch.Tensor  # the mean over target tokens, what backward() runs on
    forward_kl: float  # mean top-k forward KL over every target (comparable across losses and runs)
    tail_kl: float  # mean forward_topk_tail KL over every target (a true KL: what validation judges by)
    targets: int
    keep_kl: float | None = None  # forward top-k KL on the partner's rows (Batch.keep), when the batch has them
    hidden: float | None = None  # the whitened error to the teacher's hidden states (hidden.py)


def step_loss(name: str, logq: torch.Tensor, t: Targets) -> StepLoss:
    """`name` (LOSSES) over every target, with both KL figures."""
    loss, kl = forward_topk(logq, t)
    tail_loss, tail = forward_topk_tail(logq, t)  # once: the loss when it is the name, and the reported tail KL
    if name == "forward_topk_tail":
        loss = tail_loss
    return StepLoss(loss.mean(), float(kl.mean()), float(tail.mean()), int(loss.numel()))


def distill_loss(student: Any, cache: Any, batch: Any, loss: str = "forward_topk") -> StepLoss:
    """The step's loss over every target token of a batch (final.training.train.Batch), with its KL figures: the
    student (student.Student) reads the batch after the cache's (student.TrainableKV) keys and values, beside the
    batch's partner where it has one. Here, not beside train(), so that the trainer and both training loops
    import it without importing each other."""
    keys, values = cache.full(batch.beside)
    logq = student.log_probs(keys, values, batch.ids, batch.where, hidden=batch.hidden is not None)
    states = None
    if batch.hidden is not None:
        logq, states = logq
    out = step_loss(loss, logq, batch.targets)
    if states is not None:  # the teacher's states at every layer, asked for beside its top-k (hidden.py)
        theirs, weight = batch.hidden
        error = hidden_error(states, theirs)
        out.loss = out.loss + weight * error
        out.hidden = float(error.detach())
    if batch.keep is not None:  # rows about the partner beside us, answered as it alone would
        kept, weight = batch.keep
        k = step_loss("forward_topk", student.log_probs(keys, values, kept.ids, kept.where), kept.targets)
        out.loss = out.loss + weight * k.loss
        out.keep_kl = k.forward_kl
    return out
