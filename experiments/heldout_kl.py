"""How well a trained cartridge stands for its document: per-token KL to the full-document teacher.

On held-out conversations (synthesized questions the cartridge was not trained on, with their answers), the
teacher reads the whole document in its system turn; each student reads the same question and answer after
(a) nothing (the plain chat rendering, no document), (b) the document's first p tokens (what `build` gives at that
size, and the `prefix` initialisation of `train`), (c) the cartridge. The score is KL(teacher || student) over the
full vocabulary, averaged over answer tokens, plus how often the student's most likely token is the teacher's.
Every forward is the engine's serving forward (`runner.forward_full` after a loaded prefix), so what is measured is
what `generate(cartridge=...)` serves; the cartridge comes in already in that convention (the CLI reads it with
CartridgeService.read_served, which applies a `from_zero` file's rotation as serving does).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F

from final.cartridges.build import build_from_text
from final.training.rows import Conversation, first_of_each_question
from final.cartridges.format import CartridgeKV
from final.compat import chat_ids
from final.errors import CartridgeError


@dataclass
class KLRow:
    condition: str
    prefix_tokens: int
    kl: float  # mean KL(teacher || student) per answer token, nats
    top1: float  # share of answer positions where the student's argmax is the teacher's
    kv_bytes: int


def kl_and_top1(teacher: torch.Tensor, student: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position KL(teacher || student) and argmax agreement, from logits [N, V]."""
    t, s = F.log_softmax(teacher.float(), -1), F.log_softmax(student.float(), -1)
    return (t.exp() * (t - s)).sum(-1), (t.argmax(-1) == s.argmax(-1)).float()


def evaluate(engine: Any, tokenizer: Any, doc_ids: Sequence[int], cart: CartridgeKV,
             convs: Sequence[Conversation]) -> list[KLRow]:
    """The four conditions on `convs` (rows of a synthesized file) for a cartridge of `cart.num_tokens` tokens."""
    doc_ids, p = list(doc_ids), cart.num_tokens
    if p > len(doc_ids):
        raise CartridgeError(f"the cartridge has {p} tokens, more than the document's {len(doc_ids)}: the "
                             "first-p-tokens baseline needs p <= the document's length", field="num_tokens")
    full = build_from_text(engine, doc_ids)
    first = CartridgeKV([k[:, :, :p] for k in full.keys], [v[:, :, :p] for v in full.values], full.num_frozen_tokens)
    elem = cart.keys[0].element_size()
    sizes = {"no document": 0, f"first {p} tokens": first.nbytes // first.keys[0].element_size() * elem,
             "cartridge": cart.nbytes}
    ids = {name: f"__eval-{uuid.uuid4().hex[:8]}" for name in ("first", "cart", "full")}
    for name, kv in (("first", first), ("cart", cart), ("full", full)):
        engine.load_cartridge(ids[name], [k.to(full.dtype) for k in kv.keys], [v.to(full.dtype) for v in kv.values])
    try:
        sums = _score(engine, tokenizer, convs, ids)
    finally:
        for cid in ids.values():
            engine.unload_cartridge(cid)
    n = sum(len(c.answer_ids) for c in convs)
    prefix = {"no document": 0, f"first {p} tokens": p, "cartridge": p}
    return [KLRow(name, prefix[name], sums[name][0] / n, sums[name][1] / n, sizes[name]) for name in sizes]


def _score(engine: Any, tokenizer: Any, convs: Sequence[Conversation], ids: dict[str, str]) -> dict[str, list]:
    """Sum of per-token KL and top-1 agreement for each condition over every answer token of every row."""
    prefixes = {key: engine.prefixes.get((cid,)) for key, cid in ids.items()}
    names = _names(prefixes)
    sums = {name: [0.0, 0.0] for name in names}
    for conv in convs:
        tail = conv.prompt_ids + conv.answer_ids
        n = len(conv.answer_ids)
        teacher = _answer_logits(engine, tail, prefixes["full"], len(conv.prompt_ids), n)
        bare = chat_ids(tokenizer, [{"role": "user", "content": conv.question}], add_generation_prompt=True)
        students = {names[0]: _answer_logits(engine, list(bare) + conv.answer_ids, None, len(bare), n),
                    names[1]: _answer_logits(engine, tail, prefixes["first"], len(conv.prompt_ids), n),
                    names[2]: _answer_logits(engine, tail, prefixes["cart"], len(conv.prompt_ids), n)}
        for name, logits in students.items():
            kl, top1 = kl_and_top1(teacher, logits)
            sums[name][0] += kl.sum().item()
            sums[name][1] += top1.sum().item()
    return sums


def _names(prefixes: dict[str, Any]) -> tuple[str, ...]:
    p = prefixes["first"].length
    return ("no document", f"first {p} tokens", "cartridge")


def _answer_logits(engine: Any, ids: list[int], prefix: Any, prompt_len: int, n: int) -> torch.Tensor:
    """Logits [n, V] at the positions that predict the answer's n tokens."""
    logits, _ = engine.call(lambda runner: runner.forward_full(ids, prefix))
    return logits[prompt_len - 1:prompt_len - 1 + n]


def table(rows: Sequence[KLRow]) -> str:
    """A markdown table of the conditions."""
    lines = ["| condition | prefix tokens | KL to teacher (nats/token) | top-1 agreement | KV bytes |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r.condition} | {r.prefix_tokens} | {r.kl:.4f} | {r.top1:.3f} | {r.kv_bytes:,} |" for r in rows]
    return "\n".join(lines)



def dedupe(heldout: list[Conversation], seen: Iterable[str]) -> list[Conversation]:
    """Held-out rows whose question is not among `seen` (the training questions), each question once: a held-out
    figure on questions the cartridge was trained on measures memory, not transfer."""
    return first_of_each_question(heldout, lambda row: row.question, seen)
