"""Build a cartridge from a text (prefill once, keep the post-RoPE KV) and verify it against the text itself.

`build_from_text` is the "prefilled-cache canary" of seed 004 and the initialisation the cartridges repo uses
(the KV of the document's first tokens, the first token frozen as the attention sink). `verify` checks the
exactness of serving: (cartridge + question) must give the logits and greedy tokens of (text + question).

Token layout (final.prompts.document_ids / continuation_ids): in chat mode the document is a system turn and a
question is the rest of the conversation rendered after it, with no second BOS (the cartridge's first token is
the sink).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from final.cartridges.format import CartridgeKV
from final.errors import CartridgeError
from final.prompts import continuation_ids, document_ids  # noqa: F401 - re-exported: build and verify use them

DEFAULT_QUESTIONS = ("What is this document about?", "Summarize the document in one sentence.",
                     "List one specific fact stated in the document.")


def read_utf8(path: Path, field: str) -> str:
    """A text file a user hands in (a document, a question set, training rows), as UTF-8 with any line endings;
    one that is not UTF-8 (a Latin-1 or UTF-16 export) is a CartridgeError naming the file, the byte and `field`,
    not a UnicodeDecodeError traceback."""
    try:
        return path.read_text(encoding="utf-8-sig")  # Notepad's "UTF-8 with BOM": the mark is no text
    except UnicodeDecodeError as exc:
        raise CartridgeError(f"is not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at offset {exc.start} "
                             "(save it as UTF-8)", file=str(path), field=field) from None


def read_document(path: Path, field: str = "text") -> str:
    """The document a cartridge is built from (or trained for): an existing UTF-8 file (read_utf8)."""
    if not path.is_file():
        raise CartridgeError("text file does not exist", file=str(path), field=field)
    return read_utf8(path, field)


def build_from_text(engine: Any, ids: Sequence[int], num_frozen_tokens: int = 1) -> CartridgeKV:
    """Prefill `ids` on the engine's model and capture every layer's post-RoPE K/V as a cartridge (on CPU)."""
    ids = list(ids)
    if not ids:
        raise CartridgeError("cannot build a cartridge from zero tokens", field="num_tokens")
    if len(ids) >= engine.max_model_len:
        raise CartridgeError(f"{len(ids)} tokens do not fit the context window of {engine.max_model_len}",
                             field="num_tokens")
    _, captured = engine.call(lambda runner: runner.forward_full(ids, None, capture=True))
    keys = [k[None].to("cpu", copy=True) for k, _ in captured]
    values = [v[None].to("cpu", copy=True) for _, v in captured]
    return CartridgeKV(keys, values, max(0, min(num_frozen_tokens, len(ids))))


@dataclass
class QuestionCheck:
    question_tokens: int
    max_logit_diff: float
    reference_ids: list[int]
    cartridge_ids: list[int]

    @property
    def agreement(self) -> float:
        """Share of greedy positions where both runs chose the same token (length differences count as misses)."""
        n = max(len(self.reference_ids), len(self.cartridge_ids))
        same = sum(a == b for a, b in zip(self.reference_ids, self.cartridge_ids))
        return same / n if n else 1.0

    @property
    def same_answer(self) -> bool:
        return self.reference_ids == self.cartridge_ids


@dataclass
class VerifyReport:
    num_tokens: int
    checks: list[QuestionCheck] = field(default_factory=list)

    @property
    def max_logit_diff(self) -> float:
        return max(c.max_logit_diff for c in self.checks)

    @property
    def token_agreement(self) -> float:
        return sum(c.agreement for c in self.checks) / len(self.checks)

    @property
    def same_answers(self) -> int:
        return sum(c.same_answer for c in self.checks)

    def summary(self) -> str:
        return (f"max logit diff {self.max_logit_diff:.3e}; token agreement {self.token_agreement:.4f}; "
                f"same greedy answer {self.same_answers}/{len(self.checks)}")


def verify(engine: Any, cart: CartridgeKV, doc_ids: Sequence[int], questions: Sequence[Sequence[int]],
           max_new_tokens: int = 32) -> VerifyReport:
    """Compare (cartridge + question) with (document + question) on the engine, greedy, for each question.

    Greedy answers are generated through the serving path (async_generate with and without the cartridge);
    the logit difference is taken over the question and the reference answer, teacher-forced both ways.
    """
    doc_ids = list(doc_ids)
    if cart.num_tokens != len(doc_ids):
        raise CartridgeError(f"cartridge has {cart.num_tokens} tokens, the text renders to {len(doc_ids)}; "
                             "was it built from this text (and the same chat/raw mode)?", field="num_tokens")
    cid = f"__verify-{uuid.uuid4().hex}"
    engine.load_cartridge(cid, cart.keys, cart.values)
    report = VerifyReport(cart.num_tokens)
    greedy = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    try:
        prefix = engine.prefixes.get((cid,))
        for q in questions:
            q = list(q)
            ref = engine.generate(doc_ids + q, greedy)["output_ids"]
            got = engine.generate(q, greedy, cartridges=(cid,))["output_ids"]
            tail = q + ref
            full_logits, _ = engine.call(lambda r: r.forward_full(doc_ids + tail, None))
            cart_logits, _ = engine.call(lambda r: r.forward_full(tail, prefix))
            diff = (full_logits[len(doc_ids):] - cart_logits).abs().max().item()
            report.checks.append(QuestionCheck(len(q), diff, list(ref), list(got)))
    finally:
        engine.unload_cartridge(cid)
    return report

