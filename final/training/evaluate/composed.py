"""Two cartridges served together: do they still answer questions about both documents?

For two documents A and B, each with its question set (final.training.evaluate.questions) and its cartridge, every question of each
set is asked as final.training.evaluate.accuracy asks it (MC acc / acc_norm by log-likelihood, a greedy open answer, KL per
token of the right option) after each of these prefixes, in table order:

  no document                      the plain chat
  A in context, B in context       each whole document alone, as its system turn (the teacher, teacher_ids)
  A + B in context (and B + A)     both documents as ONE system turn: the first's text with its trailing newlines
                                   stripped, then SEPARATOR (a blank line, "\\n\\n"), then the second's text
  cartridge A, cartridge B         each cartridge alone
  cartridges A + B                 both cartridges named in one request, in that order

A composed row is served the way a user's `generate(..., cartridge=[a, b])` is: both cartridges are admitted to the
InferenceEngine's store (CartridgeService.add, the engine's load_cartridge) and the prefix is the engine's own
PrefixTable.get((a, b)), the one its core gives such a request - a per-layer concatenation of the stored post-RoPE
K/V, the first-named cartridge's tokens first. No cartridge is re-rotated: each keeps the positions it was built or
trained at (B's first key, stored after A's keys, still carries position 0), and the prompt starts at the total
prefix length.
So the order of a composition does not matter: the prefix is only ever attended to, attention is a sum over its
keys, each key carries its own position, and the prompt's positions are the same either way - B + A scores what
A + B scores up to float rounding (tests/test_distill_compose.py checks it), and only A + B is asked. The order of
two documents in one system turn does matter (the second is read after the first): both are asked.
"In context" prefixes are the documents' prefilled KV (build_from_text: what `final cartridge verify` shows to be
the document in context), served as cartridges too, as in qa_eval.

KL is to the set's own document in context. Per set, `ratio` compares a composed row with the set's own cartridge
alone and a both-documents row with the set's own document in context (acc and acc_norm; None where the
denominator is 0): the issue's "two composed cartridges keep >= 0.8x of each one's accuracy alone".
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from final.cartridges.build import build_from_text
from final.cartridges.format import CartridgeKV
from final.training.evaluate.questions import Question
from final.training.evaluate.accuracy import QARow, ask, row
from final.training.teacher import teacher_ids
from final.errors import CartridgeError

SEPARATOR = "\n\n"
NO_DOCUMENT = "no document"


@dataclass(frozen=True)
class ComposeSet:
    """One side: a set's name, its document, the questions to ask and its cartridge (in the served convention)."""

    name: str
    document: str
    questions: Sequence[Question]
    cartridge: CartridgeKV


@dataclass
class ComposeResult:
    separator: str
    composed: str  # the composed row's order, e.g. "brennock + kestrel" (row "cartridges brennock + kestrel")
    rows: dict[str, list[QARow]]  # per set name, in table order
    ratios: dict[str, dict[str, dict[str, float | None]]] = field(default_factory=dict)  # set -> condition -> acc

    def keeps(self) -> float | None:
        """The smaller of the two sets' composed/alone acc ratios (None: a cartridge alone answered nothing, so
        no ratio exists): what the done-when of composition bounds below by 0.8."""
        got = [self.ratios[s][together(self.composed)]["acc"] for s in self.ratios]
        return None if not got or None in got else min(got)

    def pooled(self) -> float | None:
        """Questions right composed / right alone over both sets, each question counted once. A set's own ratio
        divides by one cartridge's score on ~45 questions, which swung from 30 to 18 right alone between two
        starts of equal KL (bench/HISTORY.md, "The same starts on the two fresh documents"): the pooled ratio is
        the steadier figure beside keeps()."""
        right = {"alone": 0.0, "composed": 0.0}
        for name, rows in self.rows.items():
            by = {r.condition: r for r in rows}
            for key, cond in (("alone", alone(name)), ("composed", together(self.composed))):
                right[key] += by[cond].acc * by[cond].questions
        return right["composed"] / right["alone"] if right["alone"] else None


def alone(name: str) -> str:
    """The row of a set's own cartridge served alone."""
    return f"cartridge {name}"


def together(order: str) -> str:
    """The row of both cartridges served in `order` (ComposeResult.composed, e.g. "brennock + kestrel")."""
    return f"cartridges {order}"


def both_documents(first: str, second: str) -> str:
    """The one system turn that holds both documents (the "A + B in context" rows)."""
    return first.rstrip("\n") + SEPARATOR + second


def compose_evaluate(inference: Any, a: ComposeSet, b: ComposeSet, *, open_tokens: int = 32,
                     both_orders: bool = True) -> ComposeResult:
    """Every condition above for both sets (both_orders=False: both documents in context only as A then B)."""
    if a.name == b.name:
        raise CartridgeError(f"both question sets are named {a.name!r}: give two different sets", field="compose-qa")
    for s in (a, b):
        if not s.questions:
            raise CartridgeError(f"set {s.name!r} has no questions to ask", field="qa")
    prefixes = _prefixes(inference, a, b, both_orders)
    conds = _conditions(a.name, b.name, both_orders)
    loaded: dict[tuple[str, ...], str] = {}
    try:
        for key, kv in prefixes.items():  # admitted through the store, as a user's loaded cartridges are
            loaded[key] = inference.cartridges.add(f"__compose-{uuid.uuid4().hex[:8]}", kv)
        result = ComposeResult(SEPARATOR, f"{a.name} + {b.name}", {})
        for s in (a, b):
            scored = {name: ask(inference, s.questions, tuple(loaded[k] for k in keys), open_tokens)
                      for name, keys in conds}
            teacher = [got[3] for got in scored[f"{s.name} in context"]]
            result.rows[s.name] = [row(name, sum(prefixes[k].num_tokens for k in keys),
                                       sum(prefixes[k].nbytes for k in keys), scored[name], teacher, s.questions)
                                   for name, keys in conds]
            result.ratios[s.name] = _ratios(result.rows[s.name], conds, s.name)
    finally:
        for cid in loaded.values():
            inference.unload_cartridge(cid)
    return result


def _orders(x: str, y: str, both: bool) -> list[tuple[str, str]]:
    return [(x, y), (y, x)] if both else [(x, y)]


Key = tuple[str, ...]  # a prefix: ("ctx", NAME) a document in context, ("ctx", X, Y) both in one system turn,
# ("cart", NAME) a cartridge


def _prefixes(inference: Any, a: ComposeSet, b: ComposeSet, both: bool) -> dict[Key, CartridgeKV]:
    """Each prefix a condition is made of (the cartridges in the engine's dtype, as qa_eval serves them)."""
    engine, tok = inference.engine, inference.tokenizer
    docs = {a.name: a.document, b.name: b.document}
    out = {("ctx", s.name): build_from_text(engine, teacher_ids(tok, s.document)) for s in (a, b)}
    for x, y in _orders(a.name, b.name, both):
        out["ctx", x, y] = build_from_text(engine, teacher_ids(tok, both_documents(docs[x], docs[y])))
    dtype = out["ctx", a.name].dtype
    for s in (a, b):
        c = s.cartridge
        out["cart", s.name] = CartridgeKV([k.to(dtype) for k in c.keys], [v.to(dtype) for v in c.values],
                                          c.num_frozen_tokens)
    return out


def _conditions(x: str, y: str, both: bool) -> list[tuple[str, tuple[Key, ...]]]:
    """(row name, the prefixes composed in that order), in table order."""
    orders = _orders(x, y, both)
    return ([(NO_DOCUMENT, ()), (f"{x} in context", (("ctx", x),)), (f"{y} in context", (("ctx", y),))]
            + [(f"{p} + {q} in context", (("ctx", p, q),)) for p, q in orders]
            + [(alone(x), (("cart", x),)), (alone(y), (("cart", y),))]
            + [(together(f"{x} + {y}"), (("cart", x), ("cart", y)))])


def _ratios(rows: list[QARow], conds: list[tuple[str, tuple[Key, ...]]], own: str
            ) -> dict[str, dict[str, float | None]]:
    """Composed rows / the own cartridge alone; both-in-context rows / the own document in context."""
    by = {r.condition: r for r in rows}

    def ratio(r: QARow, base: QARow) -> dict[str, float | None]:
        return {k: (getattr(r, k) / getattr(base, k) if getattr(base, k) else None) for k in ("acc", "acc_norm")}

    out = {}
    for r, (_, keys) in zip(rows, conds):
        if len(keys) == 2:
            out[r.condition] = ratio(r, by[alone(own)])
        elif keys and len(keys[0]) == 3:
            out[r.condition] = ratio(r, by[f"{own} in context"])
    return out


def compose_table(result: ComposeResult, name: str) -> str:
    """One set's rows as a markdown table, 95% intervals in brackets; "x alone" is the ratio to the set's own
    cartridge alone (composed rows) or its own document in context (both-documents rows)."""
    def share(x: float, ci: tuple[float, float]) -> str:
        return f"{x:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]"

    def times(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    lines = ["| condition | prefix tokens | MC acc | MC acc_norm | acc x alone | acc_norm x alone | open: contains "
             f"| KL to {name} in context |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result.rows[name]:
        rat = result.ratios[name].get(r.condition)
        acc, norm = (times(rat["acc"]), times(rat["acc_norm"])) if rat else ("", "")
        lines.append(f"| {r.condition} | {r.prefix_tokens} | {share(r.acc, r.acc_ci)} | "
                     f"{share(r.acc_norm, r.acc_norm_ci)} | {acc} | {norm} | {share(r.contains, r.contains_ci)} | "
                     f"{r.kl:.3f} |")
    return "\n".join(lines)
