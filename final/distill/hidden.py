"""Matching the teacher's hidden states layer by layer on the rows' target positions (`learn --hidden W`).

The KL on the next token is one distribution a position: what the document did to the model on the way there - the
residual stream after every layer, at the question's and the answer's tokens - is left free, and a cartridge can
fit its rows' answers by a route the held-out questions do not take. This term asks the student (the cartridge and
the row) for the teacher's (the document and the row) hidden state after every layer at the positions the KL is
taken at. Each layer's error is measured per dimension in units of the teacher's own spread over the batch's
positions (a whitened squared error, 1 for a student as far off as another position's state), so the few
dimensions SmolLM2 keeps massive activations in do not drown the rest; the term is the mean over layers (the last
one is the final norm's output, what the logits read).

The teacher is the whole document as the system turn (final.prompts.document_ids), prefilled once; rows taught
from windows of a long document (`--teacher-tokens`) have another teacher a row, so the two are not combined.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

# the floor of a dimension's spread, as a share of the layer's mean spread: a dimension constant over the batch
# (or a batch of one position) does not turn a tiny error into a huge one
FLOOR = 0.01


class HiddenTeacher:
    """The model after the document - a prefix that is the document's whole KV, read as the student reads a
    cartridge (Student.states): `states(ids, where)` gives the teacher's hidden states at a batch's target
    positions, per layer."""

    def __init__(self, student: Any, doc_ids: Sequence[int]):
        self.student = student
        self.keys, self.values = student.prefill(doc_ids)

    @torch.no_grad()
    def states(self, ids: torch.Tensor, where: torch.Tensor) -> list[torch.Tensor]:
        """[N, hidden] per layer (fp32): the states the teacher's layers output at the `where` positions of the rows
        `ids` [B, T] read after the document (the batch's own target positions, final.distill.train.Batch)."""
        return [h.float() for h in self.student.states(self.keys, self.values, ids, where)]


def layer_states(out: Any) -> list[torch.Tensor]:
    """A decoder's output -> each layer's output state [B, T, hidden], the last one the final norm's (the logits'
    input): the same list for the teacher and the student."""
    return list(out.hidden_states[1:-1]) + [out.last_hidden_state]


def hidden_error(mine: Sequence[torch.Tensor], theirs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The mean over layers of the whitened squared error between the student's states and the teacher's ([N, hidden]
    each): per dimension over the teacher's variance across the N positions (floored at FLOOR of its mean)."""
    terms = []
    for s, t in zip(mine, theirs):
        var = t.var(0, unbiased=False)
        scale = var + FLOOR * var.mean() + 1e-12
        terms.append(((s.float() - t) ** 2 / scale).mean())
    return torch.stack(terms).mean()
