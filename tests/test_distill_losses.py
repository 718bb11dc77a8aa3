"""The reverse-KL losses against the exact reverse KL on a small vocabulary (issue 42's review: `reverse_k3`
backpropagated k3, whose expected gradient is the forward KL's). The student's samples are not drawn: the loss's
expected gradient is the sum over every token x of q(x) * grad loss(x), exact, so a biased estimator cannot pass
by luck."""

from __future__ import annotations

import pytest
import torch

from final.training.losses import Targets, reverse_k1, reverse_k3

V = 6
TEACHER = torch.log_softmax(torch.tensor([2.0, 1.5, 0.2, -1.0, 0.5, -0.3], dtype=torch.float64), -1)
STUDENT = torch.tensor([0.1, -0.4, 1.2, 0.3, -1.1, 0.8], dtype=torch.float64)  # its logits: what is trained


def exact_reverse_kl_grad() -> torch.Tensor:
    logits = STUDENT.clone().requires_grad_()
    logq = torch.log_softmax(logits, -1)
    (logq.exp() * (logq - TEACHER)).sum().backward()
    return logits.grad


def expected_grad(form, stat: str = "loss") -> torch.Tensor:
    """sum_x q(x) grad form(x): the expected gradient of a loss on one token the student sampled."""
    logits = STUDENT.clone().requires_grad_()
    logq = torch.log_softmax(logits, -1)[None].expand(V, V)  # one row per possible sample
    tokens = torch.arange(V)
    t = Targets(tokens[:, None], TEACHER[tokens][:, None], tokens, TEACHER[tokens], torch.ones(V, dtype=torch.bool))
    loss, kl = form(logq, t)
    q = torch.softmax(STUDENT, -1)
    if stat == "kl":
        return (q * kl).sum()
    (q * loss).sum().backward()
    return logits.grad


@pytest.mark.parametrize("form", [reverse_k1, reverse_k3])
def test_the_reverse_losses_expected_gradient_is_the_exact_reverse_kls(form):
    exact = exact_reverse_kl_grad()
    assert torch.allclose(expected_grad(form), exact, atol=1e-10)


def test_backpropagating_k3_alone_would_give_the_forward_kls_gradient():
    """Why reverse_k3 adds the score-function term: k3's own gradient points the forward KL's way."""
    def k3_alone(logq, t):
        lq = logq.gather(1, t.token_ids[:, None])[:, 0]
        r = t.token_logprobs - lq
        return r.exp() - r - 1, None

    logits = STUDENT.clone().requires_grad_()
    (TEACHER.exp() * (TEACHER - torch.log_softmax(logits, -1))).sum().backward()
    assert torch.allclose(expected_grad(k3_alone), logits.grad, atol=1e-10)
    assert not torch.allclose(logits.grad, exact_reverse_kl_grad(), atol=1e-3)


@pytest.mark.parametrize("form", [reverse_k1, reverse_k3])
def test_the_reported_kl_is_an_unbiased_estimate_of_the_reverse_kl(form):
    q = torch.log_softmax(STUDENT, -1)
    exact = float((q.exp() * (q - TEACHER)).sum())
    assert float(expected_grad(form, "kl")) == pytest.approx(exact, abs=1e-10)


def test_hard_adds_the_cross_entropy_of_the_rows_own_tokens_where_the_student_did_not_sample_them():
    """step_loss(hard=w): the loss is the KL form's plus w * -log q(own token), averaged over the targets, and a
    token the student sampled itself gets no cross-entropy (it would reinforce the student's own guess)."""
    from final.training.losses import forward_topk_tail, step_loss

    logq = torch.log_softmax(torch.tensor([[0.3, -0.2, 1.1, 0.0, -0.7, 0.4], [1.0, 0.2, -0.5, 0.1, 0.3, -1.2],
                                           [0.0, 0.9, 0.2, -0.3, 0.6, 0.1]], dtype=torch.float64), -1)
    tops = torch.tensor([[2, 0], [0, 4], [1, 2]])
    own = torch.tensor([2, 3, 1])
    sampled = torch.tensor([False, False, True])
    t = Targets(tops, TEACHER[tops], own, TEACHER[own], sampled)
    base = step_loss("forward_topk_tail", logq, t)
    got = step_loss("forward_topk_tail", logq, t, hard=0.5)
    ce = -(logq[0, 2] + logq[1, 3])  # the third token was sampled: none
    assert float(got.loss) == pytest.approx(float(base.loss) + 0.5 * float(ce) / 3)
    assert float(base.loss) == pytest.approx(float(forward_topk_tail(logq, t)[0].mean()))
    assert got.forward_kl == base.forward_kl and got.tail_kl == base.tail_kl  # the reported KLs are the KL's
