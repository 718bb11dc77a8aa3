"""Matching the teacher's hidden states layer by layer on the rows' target positions (`learn --hidden W`).

The KL on the next token is one distribution a position: what the document did to the model on the way there - the
residual stream after every layer, at the question's and the answer's tokens - is left free, and a cartridge can
fit its rows' answers by a route the held-out questions do not take. This term asks the student (the cartridge and
the row) for the teacher's (the document and the row) hidden state after every layer at the positions the KL is
taken at. Each layer's error is measured per dimension in units of the teacher's own spread over the batch's
positions (a whitened squared error, 1 for a student as far off as another position's state), so the few
dimensions SmolLM2 keeps massive activations in do not drown the rest; the term is the mean over layers (the last
one is the final norm's output, what the logits read).

The teacher is the rows' own: the whole document as the system turn (final.prompts.document_ids), prefilled once
(HiddenTeacher); or, for rows taught from windows of a long document (`--teacher-tokens N`), each row's N-token
window around its sentence, found again from the row's `chunk` and prefilled when needed (WindowTeacher).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

import torch

# the floor of a dimension's spread, as a share of the layer's mean spread: a dimension constant over the batch
# (or a batch of one position) does not turn a tiny error into a huge one
FLOOR = 0.01
# windows whose KV a WindowTeacher keeps (each ~12 MB at 256 tokens for SmolLM2-135M in fp32): all of a long
# document's would hold GBs (skarrow's 1,046 rows have 441 windows: 5 GB), so the rest are prefilled again
KEPT_WINDOWS = 64
# the most bytes of rows' teacher states KeptStates keeps (fp32, 30 layers x 576 a target token): brennock's 158
# rows take 660 MB; skarrow's 1,046 window rows would take ~4 GB, and about half are kept
KEPT_BYTES = 2 << 30


class HiddenTeacher:
    """The model after the document - a prefix that is the document's whole KV, read as the student reads a
    cartridge (Student.states): `states(ids, where)` gives the teacher's hidden states at a batch's target
    positions, per layer."""

    def __init__(self, student: Any, doc_ids: Sequence[int]):
        self.student = student
        self.keys, self.values = student.prefill(doc_ids)

    @torch.no_grad()
    def states(self, ids: torch.Tensor, where: torch.Tensor, rows: Sequence[Any] = ()) -> list[torch.Tensor]:
        """[N, hidden] per layer (fp32): the states the teacher's layers output at the `where` positions of the rows
        `ids` [B, T] read after the document (the batch's own target positions, final.training.train.Batch). `rows`
        (the batch's Conversations) is not needed: every row has this one teacher."""
        return [h.float() for h in self.student.states(self.keys, self.values, ids, where)]


class WindowTeacher:
    """The model after each row's own window of a long document (`--teacher-tokens`): the `tokens`-token window
    around the row's sentence, or the tile that holds it (`tiled`, `--teacher-tiles`) (its `chunk`,
    final.training.document.facts.window_text), the teacher its KL targets were scored by; each window prefilled when a row
    needs it, the last KEPT_WINDOWS kept."""

    def __init__(self, student: Any, tokenizer: Any, text: str, tokens: int, tiled: bool = False):
        from final.training.teacher import token_offsets

        self.student, self.tokenizer, self.text, self.tokens, self.tiled = student, tokenizer, text, tokens, tiled
        self.offsets = token_offsets(tokenizer, text)
        self.kept: OrderedDict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = OrderedDict()

    def _window_text(self, chunk: Sequence[int]) -> str:
        """The window around the document's tokens `chunk` = [first, last), as its teacher read it."""
        from final.training.teacher import window_text
        from final.errors import CartridgeError

        first, last = chunk
        if not 0 <= first < last <= len(self.offsets):
            raise CartridgeError(f"a row's chunk {list(chunk)} is not a span of the document's {len(self.offsets)} "
                                 "tokens: its rows were made from another document", field="chunk")
        return window_text(self.text, self.offsets, chunk, self.tokens, self.tiled)

    def _kv(self, window: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        from final.prompts import document_ids

        if window not in self.kept:
            self.kept[window] = self.student.prefill(document_ids(self.tokenizer, window))
            if len(self.kept) > KEPT_WINDOWS:
                self.kept.popitem(last=False)
        self.kept.move_to_end(window)
        return self.kept[window]

    @torch.no_grad()
    def states(self, ids: torch.Tensor, where: torch.Tensor, rows: Sequence[Any] = ()) -> list[torch.Tensor]:
        """As HiddenTeacher.states, each row of `rows` (the Conversations of `ids`, in order) after its own window:
        one forward a window (the rows that share it together), the states put back in the rows' order."""
        if len(rows) != len(ids):
            raise ValueError(f"{len(ids)} rows of ids need their {len(ids)} Conversations, got {len(rows)}")
        groups: OrderedDict[str, list[int]] = OrderedDict()
        for r, row in enumerate(rows):  # every chunk checked before any forward
            groups.setdefault(self._window_text(row.chunk), []).append(r)
        counts = where.sum(1).tolist()
        per_row: list[list[torch.Tensor]] = [[] for _ in rows]
        for window, idx in groups.items():
            layers = self.student.states(*self._kv(window), ids[idx], where[idx])
            for h in layers:  # [the group's positions, hidden], row by row in the group's order
                for r, part in zip(idx, torch.split(h, [counts[r] for r in idx])):
                    per_row[r].append(part)
        return [torch.cat([layers[i] for layers in per_row]).float() for i in range(len(per_row[0]))]


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
    """A teacher (HiddenTeacher or WindowTeacher) whose states are kept per row: `learn` goes over its rows a dozen
    times (240 steps x 8 of ~160), and a row's teacher states depend on the row alone, so each is computed once,
    the batch's missing rows together, and then read (a step's teacher forward was ~30% of it:
    bench/RESULTS.md). Up to `budget` bytes are kept (fp32, as used); past that a row is computed each time."""

    def __init__(self, teacher: Any, budget: int = KEPT_BYTES):
        self.teacher, self.budget, self.used = teacher, budget, 0
        self.kept: dict[bytes, list[torch.Tensor]] = {}

    @torch.no_grad()
    def states(self, ids: torch.Tensor, where: torch.Tensor, rows: Sequence[Any] = ()) -> list[torch.Tensor]:
        """As the teacher's states(), the same rows in the same order."""
        keys = [_row_key(i, w) for i, w in zip(ids, where)]
        missing = [r for r, k in enumerate(keys) if k not in self.kept]
        fresh: dict[int, list[torch.Tensor]] = {}
        if missing:
            got = self.teacher.states(ids[missing], where[missing], [rows[r] for r in missing] if rows else ())
            counts = where[missing].sum(1).tolist()
            parts = [torch.split(h, counts) for h in got]  # per layer, per row
            for n, r in enumerate(missing):
                fresh[r] = [layer[n] for layer in parts]
                size = sum(x.numel() * x.element_size() for x in fresh[r])
                once = bool(rows) and rows[r].sampled  # an on-policy row is new each step: never read again
                if not once and self.used + size <= self.budget:
                    self.kept[keys[r]], self.used = fresh[r], self.used + size
        per_row = [fresh.get(r) or self.kept[k] for r, k in enumerate(keys)]
        return [torch.cat([row[i] for row in per_row]) for i in range(len(per_row[0]))]


def _row_key(ids: torch.Tensor, where: torch.Tensor) -> bytes:
    """A row's identity for its teacher states: its tokens and target positions (its padding aside)."""
    last = int(where.nonzero().max()) + 2 if where.any() else len(ids)
    return ids[:last].cpu().numpy().tobytes() + where[:last].cpu().numpy().tobytes()
