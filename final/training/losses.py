"""Distillation losses on a cartridge's student, per target token, and the KL each reports.

`forward_topk` is the cartridges repo's loss (`train.py`, loss_type="logits") and veRL 0.9's `forward_kl_topk`:
-sum_k p_teacher(k) log q_student(k) over the teacher's top-k ids, not renormalised. Its value includes the
teacher's entropy over those k, so the KL reported beside it is that cross-entropy minus the teacher's top-k
entropy, sum_k p (log p - log q): 0 when the student equals the teacher on the top-k, and below 0 when the
student moves the tail's mass onto them. `forward_topk_tail` adds the rest of the vocabulary as one bucket,
which makes it a true KL (>= 0; validation judges by it).

The reverse forms need the token to be the student's own sample (on-policy rows); the teacher gives log p of it:
- `reverse_k1`: Thinking Machines' on-policy distillation / a policy gradient with per-token advantage
  -(log q - log p): the surrogate (log q - log p).detach() * log q has the gradient of KL(q || p) on the sample.
- `reverse_k3`: veRL's `low_var_kl` k3 = exp(r) - r - 1, r = log p - log q, as the reported KL (>= 0, unbiased, low
  variance). Backpropagating k3 itself (what the public on-policy cartridge trainer does) is wrong: its gradient
  averaged over the student's samples is sum_x q (1 - p/q) grad log q = -sum_x p grad log q, the *forward* KL's.
  The sample's own probability depends on the cartridge too, so the loss adds the score-function term
  k3.detach() * log q; the sum's expectation, E_q[(k3 + 1 - p/q) grad log q] = E_q[(log q - log p) grad log q], is
  the reverse KL's gradient (tests/test_distill_losses.py checks both against the exact one on a small vocabulary).
Each step reports the forward top-k KL over every target (one figure that compares across losses and runs) and,
on sampled tokens, the mean k1 = log q - log p, an unbiased estimate of KL(q || p) (negative on one token at times).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from final.training.hidden import hidden_error
from final.training.quiet import measured

LOSSES = ("forward_topk", "forward_topk_tail", "reverse_k1", "reverse_k3")


@dataclass
class Targets:
    """What the teacher said at N target positions (in row order): its top-k and, for sampled tokens, the token
    and the teacher's logprob of it. `sampled` marks positions whose token the student itself sampled."""
    top_ids: torch.Tensor  # [N, k]
    top_logprobs: torch.Tensor  # [N, k]
    token_ids: torch.Tensor  # [N]
    token_logprobs: torch.Tensor  # [N] the teacher's log p of token_ids (0 where unknown: not sampled)
    sampled: torch.Tensor  # [N] bool


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


def reverse_k1(logq: torch.Tensor, t: Targets) -> tuple[torch.Tensor, torch.Tensor]:
    lq = logq.gather(1, t.token_ids[:, None])[:, 0]
    k1 = lq - t.token_logprobs
    return k1.detach() * lq, k1.detach()


def reverse_k3(logq: torch.Tensor, t: Targets) -> tuple[torch.Tensor, torch.Tensor]:
    lq = logq.gather(1, t.token_ids[:, None])[:, 0]
    r = t.token_logprobs - lq
    k3 = r.exp() - r - 1
    return k3 + k3.detach() * lq, k3.detach()  # pathwise + score-function term: the reverse KL's gradient


_FORMS = {"forward_topk": forward_topk, "forward_topk_tail": forward_topk_tail, "reverse_k1": reverse_k1,
          "reverse_k3": reverse_k3}


@dataclass
class StepLoss:
    loss: torch.Tensor  # the mean over target tokens, what backward() runs on
    forward_kl: float  # mean top-k forward KL over every target (comparable across losses and runs)
    tail_kl: float  # mean forward_topk_tail KL over every target (a true KL: what validation judges by)
    reverse_kl: float | None  # mean k1 estimate of KL(student || teacher) on the student's own samples
    targets: int
    keep_kl: float | None = None  # forward top-k KL on the partner's rows (Batch.keep), when the batch has them
    quiet: float | None = None  # our KV's mean loudness to those rows (final/distill/quiet.py), when weighed
    hidden: float | None = None  # the whitened error to the teacher's hidden states (final/distill/hidden.py)


def step_loss(name: str, logq: torch.Tensor, t: Targets, hard: float = 0.0) -> StepLoss:
    """`name` on the student's own samples, a forward form everywhere else (forward_topk_tail if it is the name,
    else forward_topk: a reverse KL estimated on a token the student did not sample, e.g. a question the teacher
    wrote or an off-policy answer, has no meaning). `hard`: the weight of the cross-entropy of the row's own token
    where the student did not sample it (a fact row's words are the document's, not the teacher's guess)."""
    loss, kl = forward_topk(logq, t)
    tail_loss, tail = forward_topk_tail(logq, t)  # once: the loss when it is the name, and the reported tail KL
    if name == "forward_topk_tail":
        loss = tail_loss
    if hard:
        own = -logq.gather(1, t.token_ids[:, None]).squeeze(1)
        loss = loss + hard * torch.where(t.sampled, torch.zeros_like(own), own)
    reverse = None
    if bool(t.sampled.any()):
        if name not in ("forward_topk", "forward_topk_tail"):
            loss = torch.where(t.sampled, _FORMS[name](logq, t)[0], loss)
        reverse = float(reverse_k1(logq, t)[1][t.sampled].mean())
    return StepLoss(loss.mean(), float(kl.mean()), float(tail.mean()), reverse, int(loss.numel()))


def distill_loss(student: Any, cache: Any, batch: Any, loss: str = "forward_topk", hard: float = 0.0) -> StepLoss:
    """The step's loss over every target token of a batch (final.training.train.Batch), with its KL figures: the
    student (student.Student) reads the batch after the cache's (student.TrainableKV) keys and values. Here, not
    beside train(), so that the trainer and both training loops import it without importing each other."""
    keys, values = cache.full(batch.beside)
    quiet = batch.keep is not None and bool(batch.quiet)
    ratio = quiet and batch.quiet_by == "ratio"  # our loudness to our own rows is the denominator
    with _heard(student, cache, batch, batch.where, ratio) as own:
        logq = student.log_probs(keys, values, batch.ids, batch.where, share=not ratio,
                                 hidden=batch.hidden is not None)
    states = None
    if batch.hidden is not None:
        logq, states = logq
    out = step_loss(loss, logq, batch.targets, hard)
    if states is not None:  # the teacher's states at every layer, asked for beside its top-k (hidden.py)
        theirs, weight = batch.hidden
        error = hidden_error(states, theirs)
        out.loss = out.loss + weight * error
        out.hidden = float(error.detach())
    if batch.keep is not None:  # rows about the partner beside us, answered as it alone would
        kept, weight = batch.keep
        # the loudness is read per layer call, so the rows' shared head is not run apart (share=False) when weighed
        with _heard(student, cache, batch, kept.where, quiet) as loud:
            logq = student.log_probs(keys, values, kept.ids, kept.where, share=not quiet)
        if quiet:
            heard = loud.mean() / own.mean() if ratio else loud.mean()
            out.loss = out.loss + batch.quiet * heard
            out.quiet = float(heard.detach())
        k = step_loss("forward_topk", logq, kept.targets)
        out.loss = out.loss + weight * k.loss
        out.keep_kl = k.forward_kl
    return out


def _heard(student: Any, cache: Any, batch: Any, where: torch.Tensor, on: bool) -> Any:
    """Our trainable span's loudness (or mass) to the rows read within the block, where measured (`on`)."""
    if not on:
        return nullcontext()
    return measured(student.model, *cache.span(batch.beside), where, "mass" if batch.quiet_by == "mass" else "loudness")
