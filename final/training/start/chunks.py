"""The `select` / `match` start for `learn`: the cartridge begins as the document's own KV, read chunk by chunk.

`learn` otherwise starts from the document's first P tokens: on a 6.7k-token document with P = 256 everything
after the first 4% is missing at step 0, and training has to write every later fact into the KV from nothing. A
135M model reads such a document poorly as a whole (0.40 on skarrow's tune half) and each 256-token window well
(0.77), so the start is cut from the windows' KV, not the whole document's: the document is tiled into
`chunk_tokens`-token chunks (one chunk, the whole document, without --teacher-tokens), each prefilled alone as the
teacher's system turn - the KV its fact rows' teacher reads - and keeps its share of the P - frozen positions, per
KV head, by the attention its own fact rows give them (final.training.start.select: SnapKV's criterion, the rows as the
observation window). With `fit` (`match`), each chunk's kept values are refitted so its rows' head outputs are the
chunk's (final.training.start.match). The leading `frozen` positions (the template's start, the same tokens in every
chunk, so the same KV) are kept once.

Positions: chunk i's kept keys are rotated by R_{P - L_i} (final.cartridges.positions), so a token after the
cartridge scores each chunk's keys as it would right after that chunk alone - the place its teacher's question
sat. Every chunk is equally near: the cartridge has no order beyond the one its heads' positions keep.

Measured (bench/RESULTS.md, issue 42): one chunk, the whole document, p = 64, two fresh documents (88 questions) -
`match` (`learn`'s default without --teacher-tokens) 45 right alone and 26 composed with the other's cartridge,
`select` 34 and 36, the first P tokens 35 and 38: match's least-squares values, 3x the document's own in norm,
answer more alone and disturb a neighbour's questions (a ridge of 0.1 toward the document's values: 40 and 30).
Per 256-token window of a 6.7k-token document, p = 256 - worse than its first 256 tokens before training and after
(0.21 against 0.32): nine positions a chunk, each read in its own chunk, do not add up to the document.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from final.cartridges.positions import rotate, rotation
from final.training.rows import Conversation
from final.errors import CartridgeError

INITS = ("prefix", "select", "match")
ROWS_PER_CHUNK = 16  # observation rows per chunk: select measured 16 conversations enough on a whole document


def tiles(n: int, size: int) -> list[tuple[int, int]]:
    """[lo, hi) token ranges of size `size` covering 0..n; the last one is not left as a sliver (< size / 2): it
    joins the one before."""
    out = [(lo, min(lo + size, n)) for lo in range(0, n, size)]
    if len(out) > 1 and out[-1][1] - out[-1][0] < size // 2:
        out[-2:] = [(out[-2][0], out[-1][1])]
    return out


def shares(total: int, weights: Sequence[int]) -> list[int]:
    """`total` split in proportion to `weights` (largest remainders; the shares sum to total)."""
    raw = [total * w / sum(weights) for w in weights]
    out = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: out[i] - raw[i])[:total - sum(out)]:
        out[i] += 1
    return out


def observed(convs: Sequence[Conversation], lo: int, hi: int, count: int) -> list[list[int]]:
    """Up to `count` rows about the chunk's tokens [lo, hi) (their sentences overlap it), spread evenly over them in
    the rows' order: the observation window that chooses what the chunk keeps."""
    mine = [c for c in convs if c.chunk[0] < hi and c.chunk[1] > lo]
    if len(mine) > count:
        mine = [mine[i * len(mine) // count] for i in range(count)]
    return [c.ids for c in mine]


def template(tokenizer) -> tuple[int, int]:
    """How many of a system turn's ids come before its text and after it (the chat template's)."""
    from final.training.teacher import teacher_ids

    a, b = teacher_ids(tokenizer, "A"), teacher_ids(tokenizer, "B")
    head = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return head, len(a) - head - 1


def chunked_init(student: "Student", model_dir: str | Path, tokenizer, text: str,  # noqa: F821 - student.Student
                 convs: Sequence[Conversation], p: int, frozen: int, chunk_tokens: int | None,
                 fit: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The p-token start K/V (per layer [1, kv_heads, p, D]) from the document's chunks (module docstring).
    `convs`: the fact rows (their `chunk` is the token range of the document they ask about)."""
    from final.training.teacher import token_offsets
    from final.training.start.select import attention_mass, gather_kv, select_positions
    from final.training.teacher import teacher_ids

    offsets = token_offsets(tokenizer, text)
    head, tail = template(tokenizer)
    spans = tiles(len(offsets), chunk_tokens or len(offsets))
    budget = p - frozen
    if budget < len(spans):
        raise CartridgeError(f"a {p}-token cartridge cannot keep a position of each of the document's {len(spans)} "
                             f"chunks: use more --tokens or a larger --teacher-tokens", field="tokens")
    keys: list[list[torch.Tensor]] = []
    values: list[list[torch.Tensor]] = []
    for i, ((lo, hi), n) in enumerate(zip(spans, shares(budget, [hi - lo for lo, hi in spans]))):
        ids = teacher_ids(tokenizer, text[offsets[lo][0]:offsets[hi - 1][1]])
        rows = observed(convs, lo, hi, ROWS_PER_CHUNK)
        if not rows:
            raise CartridgeError(f"no fact row asks about the document's tokens {lo}..{hi}: nothing to choose that "
                                 "chunk's positions by", field="init")
        mass = attention_mass(student, ids, rows)
        # one system turn's template, not one per chunk: its head kept from the first chunk only, its end (which
        # every question attends to) from the last only
        mass[..., frozen:(head if i else frozen)] = -1.0
        mass[..., (len(ids) - tail if i < len(spans) - 1 else len(ids)):] = -1.0
        positions = select_positions(mass, n + frozen, frozen)
        k, v = gather_kv(*student.prefill(ids), positions)
        if fit:
            from final.training.start.match import fit_values

            v = fit_values(student, ids, rows, positions, k, v, frozen)
        cos, sin = rotation(model_dir, p - len(ids), k[0].shape[-1], str(model_dir))
        k = [rotate(x, cos.to(x.device), sin.to(x.device)) for x in k]
        cut = 0 if i == 0 else frozen  # the sink once: every chunk's first `frozen` ids are the template's
        keys.append([x[:, :, cut:] for x in k])
        values.append([x[:, :, cut:] for x in v])
    return ([torch.cat(layer, 2) for layer in zip(*keys)], [torch.cat(layer, 2) for layer in zip(*values)])


def start(student: "Student", path: Path, tok: Any, convs: Sequence[Conversation],  # noqa: F821 - student.Student
          cfg: Any, first: tuple[list[int], str], text: str | None, init: str, chunk_tokens: int | None,
          resumed: bool) -> tuple[Any, str, str]:
    """train_cartridge's KV start, its manifest label and its fingerprint (what a resume must match): `first` (the
    first P ids and their label, train._init_ids) for prefix, else the select / match start (chunked_init); a
    resumed run prefills `first` for the shape only, the checkpoint's values replacing it."""
    from final.training.train import digest
    from final.prompts import document_ids

    ids, kind = first
    if init == "prefix":
        return student.prefill(ids), kind, digest(ids)
    if init not in INITS:
        raise CartridgeError(f"unknown init {init!r}; choose from {list(INITS)}", field="init")
    if text is None:
        raise CartridgeError(f"init {init} cuts the start from the document: give --text", field="init")
    label = f"{init}/{chunk_tokens}" if chunk_tokens else init
    fingerprint = f"{label}:{digest(document_ids(tok, text))}"
    if resumed:
        return student.prefill(ids), label, fingerprint
    return (chunked_init(student, path, tok, text, convs, cfg.tokens, cfg.frozen_tokens, chunk_tokens,
                         fit=init == "match"), label, fingerprint)
