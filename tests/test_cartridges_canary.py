"""Canary parity on SmolLM2-135M-Instruct (fp32, CPU): for 5 documents x 3 questions a cartridge built from the
document answers exactly as the document in the prompt does, and mixed-cartridge batches do not contaminate."""

from __future__ import annotations

import pytest
from cartridges_helpers import SMOLLM2, documents, open_engine

from final.cartridges.build import build_from_text, continuation_ids, document_ids, verify
from final.cartridges.service import CartridgeService

pytestmark = pytest.mark.slow
MAX_NEW = 24


@pytest.fixture(scope="module")
def smol():
    engine, tok = open_engine(SMOLLM2)
    service = CartridgeService(engine)
    docs = {}
    for name, (text, questions) in documents().items():
        ids = document_ids(tok, text)
        cart = build_from_text(engine, ids)
        service.add(name, cart)
        docs[name] = (ids, cart, [continuation_ids(tok, q) for q in questions], questions)
    yield engine, tok, docs
    engine.shutdown()


def test_canary_parity_five_documents_three_questions(smol):
    engine, tok, docs = smol
    assert len(docs) >= 5
    diffs = {}
    for name, (ids, cart, qs, questions) in docs.items():
        assert len(qs) >= 3
        report = verify(engine, cart, ids, qs, MAX_NEW)
        for question, check in zip(questions, report.checks):
            diffs[(name, question)] = check.max_logit_diff
            answer = tok.decode(check.reference_ids, skip_special_tokens=True)
            assert check.same_answer, f"{name}: {question!r} -> {answer!r} vs " \
                                      f"{tok.decode(check.cartridge_ids, skip_special_tokens=True)!r}"
            assert check.max_logit_diff < 1e-3, (name, question, check.max_logit_diff)
            print(f"{check.max_logit_diff:.2e}  {name:15} {question} -> {answer.strip()!r}")
    print(f"canary: {len(diffs)} question(s), max logit diff {max(diffs.values()):.3e}")


def test_canary_answers_come_from_the_document(smol):
    """The check is not vacuous: with the cartridge the model answers from the document."""
    engine, tok, docs = smol
    ids, cart, qs, _ = docs["planet.txt"]
    out = engine.generate(qs[2], {"max_new_tokens": MAX_NEW, "temperature": 0.0}, cartridges=("planet.txt",))
    assert "Dunmere" in tok.decode(out["output_ids"])


def test_two_cartridges_in_one_batch_match_single_runs(smol):
    engine, tok, docs = smol
    names = ["lighthouse.txt", "bakery.txt", "robot.txt"]
    rows = [(docs[n][2][i], n) for i in range(3) for n in names]
    greedy = {"max_new_tokens": MAX_NEW, "temperature": 0.0}
    singles = [engine.generate(q, greedy, cartridges=(n,))["output_ids"] for q, n in rows]
    batch = engine.generate([q for q, _ in rows], greedy, cartridges=[(n,) for _, n in rows])
    assert [o["output_ids"] for o in batch] == singles
