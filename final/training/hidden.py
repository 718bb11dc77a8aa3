"""Matching the teacher's hidden states layer by layer on the rows' target positions (`learn`, settings key `hidden`).

The KL on the next token is one distribution a position: what the document did to the model on the way there - the
residual stream after every layer, at the question's and the answer's tokens - is left free, and a cartridge can
fit its rows' answers by a route the held-out questions do not take. This term asks the student (the cartridge and
the row) for the teacher's (the document and the row) hidden state after every layer at the positions the KL is
taken at. Each layer's error is measured per dimension in units of the teacher's own spread over the batch's
positions (a whitened squared error, 1 for a student as far off as another position's state), so the few
dimensions SmolLM2 keeps massive activations in do not drown the rest; the term is the mean over layers (the last
one is the final norm's output, what the logits read).

The teacher is the rows' own: the whole document as the system turn (final.prompts.document_ids), prefilled once
(HiddenTeacher), each row's states computed once and kept (KeptStates). Measured: bench/RESULTS.md, "Matching the
teacher's hidden states".
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

# the floor of a dimension's spread, as a share of the layer's mean spread: a dimension constant over the batch
# (or a batch of one position) does not turn a tiny error into a huge one
FLOOR = 0.01
# the most bytes of rows' teacher states KeptStates keeps (fp32, 30 layers x 576 a target token): brennock's 158
# rows take 660 MB; a 6,700-token document's ~1,000 rows ~4 GB, and about half are kept
KEPT_BYTES = 2 << 30


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
        `ids` [B, T] read after the document (the batch's own target positions, final.training.train.Batch)."""
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


class KeptStates:
    """A HiddenTeacher whose states are kept per row: `learn` goes over its rows a dozen times (240 steps x 8 of
    ~160), and a row's teacher states depend on the row alone, so each is computed once, the batch's missing rows
    together, and then read (the teacher's forward was a third of a step: bench/RESULTS.md, "Matching the teacher's
    hidden states"). Up to `budget` bytes are kept (fp32, as used); past that a row is computed each time."""

    def __init__(self, teacher: Any, budget: int = KEPT_BYTES):
        self.teacher, self.budget, self.used = teacher, budget, 0
        self.kept: dict[bytes, list[torch.Tensor]] = {}

    @torch.no_grad()
    def states(self, ids: torch.Tensor, where: torch.Tensor) -> list[torch.Tensor]:
        """As the teacher's states(), the same rows in the same order."""
        keys = [_row_key(i, w) for i, w in zip(ids, where)]
        missing = [r for r, k in enumerate(keys) if k not in self.kept]
        fresh: dict[int, list[torch.Tensor]] = {}
        if missing:
            got = self.teacher.states(ids[missing], where[missing])
            counts = where[missing].sum(1).tolist()
            parts = [torch.split(h, counts) for h in got]  # per layer, per row
            for n, r in enumerate(missing):
                fresh[r] = [layer[n] for layer in parts]
                size = sum(x.numel() * x.element_size() for x in fresh[r])
                if self.used + size <= self.budget:
                    self.kept[keys[r]], self.used = fresh[r], self.used + size
        per_row = [fresh.get(r) or self.kept[k] for r, k in enumerate(keys)]
        return [torch.cat([row[i] for row in per_row]) for i in range(len(per_row[0]))]


def _row_key(ids: torch.Tensor, where: torch.Tensor) -> bytes:
    """A row's identity for its teacher states: its tokens and target positions (its padding aside)."""
    last = int(where.nonzero().max()) + 2 if where.any() else len(ids)
    return ids[:last].cpu().numpy().tobytes() + where[:last].cpu().numpy().tobytes()
