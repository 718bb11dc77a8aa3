"""The KV a cartridge's training starts from (`learn --init`, the distill loop's `init` setting):

  prefix  the first P tokens of the document (the cartridges repo's start), or of the first row where there is no
          document (a tool-use cartridge starts as the prompt it is trained under);
  select  the document's own KV, P positions per KV head, kept by the attention the rows give them (select.py);
  match   select's positions, their values refitted so the heads' outputs are the document's (match.py).

Why match is `learn`'s default and select the start for cartridges served together: bench/RESULTS.md, "A start cut
from the document's own KV".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from final.errors import CartridgeError
from final.prompts import document_ids
from final.training.rows import Conversation
from final.training.settings import INITS
from final.training.start.select import select_init
from final.training.student import Student
from final.training.teacher import teacher_ids
from final.training.trainer import digest

OBSERVED = 16  # rows whose attention picks the positions: 16 self-study conversations were measured enough


def initial_ids(tokenizer: Any, text: str, tokens: int, what: str = "text") -> list[int]:
    """The first `tokens` ids of the text rendered as a cartridge's document (a system turn): the `prefix` start,
    and the first-p-tokens baseline (a cartridge built from the whole text, cut at p, is the same KV)."""
    ids = document_ids(tokenizer, text)
    if len(ids) < tokens:
        raise CartridgeError(f"renders to {len(ids)} tokens, fewer than the {tokens} the cartridge needs",
                             field=what)
    return ids[:tokens]


def observed(convs: Sequence[Conversation], count: int = OBSERVED) -> list[list[int]]:
    """Up to `count` rows' token streams, spread evenly over them in order: the observation window of the start."""
    rows = list(convs)
    if len(rows) > count:
        rows = [rows[i * len(rows) // count] for i in range(count)]
    return [c.ids for c in rows]


def select_start(student: Student, model_dir: str | Path, doc_ids: Sequence[int], rows: Sequence[Sequence[int]],
                 p: int, frozen: int, init: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The select or match start of a p-token cartridge of the document (its teacher's ids `doc_ids`), the
    positions picked by `rows` (token streams read after the document)."""
    if init not in ("select", "match"):
        raise CartridgeError(f"unknown init {init!r}; choose from {list(INITS)}", field="init")
    return select_init(student, model_dir, doc_ids, rows, p, frozen, fit=init == "match")


def initial_kv(student: Student, model_dir: str | Path, tok: Any, convs: Sequence[Conversation], cfg: Any,
               text: str | None, init: str, resumed: bool) -> tuple[Any, str, str]:
    """train_cartridge's start, its manifest label and its fingerprint (what a resume must match). A resumed run
    prefills the prefix ids for the shape only: the checkpoint's values replace them."""
    if init not in INITS:
        raise CartridgeError(f"unknown init {init!r}; choose from {list(INITS)}", field="init")
    if text is not None:
        ids, label = initial_ids(tok, text, cfg.tokens), "prefix"
    else:
        ids, label = convs[0].ids[:cfg.tokens], "data"
        if len(ids) < cfg.tokens:
            raise CartridgeError(f"the first row has {len(convs[0].ids)} tokens, fewer than the {cfg.tokens} the "
                                 "cartridge needs: give --text", field="tokens")
    if init == "prefix":
        return student.prefill(ids), label, digest(ids)
    if text is None:
        raise CartridgeError(f"init {init} cuts the start from the document: give --text", field="init")
    doc = teacher_ids(tok, text)
    fingerprint = f"{init}:{digest(document_ids(tok, text))}"
    if resumed:
        return student.prefill(ids), init, fingerprint
    rows = observed(convs)
    if not rows:
        raise CartridgeError("no row to choose the start's positions by", field="init")
    return select_start(student, model_dir, doc, rows, cfg.tokens, cfg.frozen_tokens, init), init, fingerprint
