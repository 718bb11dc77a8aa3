"""The `match` initialisation (final/distill/match.py): select's positions, values fitted by least squares so the
cartridge's heads give the teacher's outputs."""

from __future__ import annotations

import pytest
import torch

from cartridges_helpers import TINY
from serve_helpers import DOC_A
from final.training.start.match import ATTN, _Recorder, fit_values
from final.training.start.select import attention_mass, select_init, select_kv, select_positions
from final.training.student import Student
from final.models import resolve_model_path
from final.prompts import continuation_ids, document_ids

from training_helpers import inference  # noqa: F401  (the module's engine fixture, one rule)

QUESTIONS = ("Who keeps the light?", "When was it built?", "What does the keeper do at night?", "Where is it?")


@pytest.fixture(scope="module")
def setup(inference):  # noqa: F811
    tok = inference.tokenizer
    student = Student(resolve_model_path(TINY), dtype="float32")
    doc = document_ids(tok, DOC_A)
    rows = [continuation_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    return student, doc, rows


def _kl(student, doc, keys, values, row):
    """Mean KL(teacher || student) over the row's tokens, the teacher reading the whole document."""
    ids = torch.tensor([row])
    where = torch.ones_like(ids, dtype=torch.bool)
    teacher = student.log_probs(*student.prefill(doc), ids, where)
    mine = student.log_probs(keys, values, ids, where)
    return float((teacher.exp() * (teacher - mine)).sum(-1).mean())


def test_the_fitting_pass_leaves_the_models_output_unchanged(setup):
    """The recording attention function computes the attention itself (causal after the cached document)."""
    from transformers import AttentionInterface, DynamicCache

    student, doc, rows = setup
    model, L = student.model, len(doc)
    positions = select_positions(attention_mass(student, doc, rows), 8, 1)
    recorder = _Recorder(model, L, positions)
    AttentionInterface.register(ATTN, recorder)

    def logits(impl):
        cache = DynamicCache()
        model(torch.tensor([doc]), past_key_values=cache, use_cache=True)
        model.set_attn_implementation(impl)
        try:
            return model(torch.tensor([rows[0]]), past_key_values=cache, use_cache=True).logits
        finally:
            model.set_attn_implementation("sdpa")

    assert torch.allclose(logits(ATTN), logits("sdpa"), atol=1e-4)
    assert recorder.gram.abs().sum() > 0 and recorder.rhs.abs().sum() > 0  # the row after the document was recorded


def test_fitting_every_position_gives_back_the_documents_own_values(setup):
    student, doc, rows = setup
    positions = select_positions(attention_mass(student, doc, rows), len(doc), 1)
    keys, values = student.prefill(doc)
    fitted = fit_values(student, doc, rows, positions, keys, values, 1, ridge=0.0)
    assert all(torch.allclose(f, v, atol=1e-4) for f, v in zip(fitted, values))


def test_fitted_values_bring_the_cartridge_closer_to_the_teacher_and_keep_the_sink(setup):
    student, doc, rows = setup
    p = 8
    model_dir = resolve_model_path(TINY)
    positions = select_positions(attention_mass(student, doc, rows), p, 1)
    keys, values = select_kv(*student.prefill(doc), positions, model_dir)
    fk, fv = select_init(student, model_dir, doc, rows, p, 1, fit=True)
    assert all(torch.equal(a, b) for a, b in zip(fk, keys))  # the keys are select's
    assert all(torch.equal(a[:, :, :1], b[:, :, :1]) for a, b in zip(fv, values))  # the frozen sink kept
    assert any(not torch.allclose(a, b) for a, b in zip(fv, values))
    selected = sum(_kl(student, doc, keys, values, r) for r in rows)
    matched = sum(_kl(student, doc, fk, fv, r) for r in rows)
    assert matched < selected


def test_sequential_fitting_starts_as_the_independent_one_and_also_brings_the_cartridge_closer(setup):
    """Layer 0's queries are the same in the teacher and the student (nothing below it differs), so its
    sequential fit is the independent one; the layers above fit the student's own queries."""
    student, doc, rows = setup
    model_dir = resolve_model_path(TINY)
    positions = select_positions(attention_mass(student, doc, rows), 8, 1)
    keys, values = select_kv(*student.prefill(doc), positions, model_dir)
    alone = fit_values(student, doc, rows, positions, keys, values, 1)
    chained = fit_values(student, doc, rows, positions, keys, values, 1, sequential=True)
    assert torch.allclose(chained[0], alone[0], atol=1e-3, rtol=1e-3)
    assert not torch.allclose(chained[-1], alone[-1], atol=1e-5)
    assert student.model.config._attn_implementation == "sdpa"
    assert sum(_kl(student, doc, keys, chained, r) for r in rows) < sum(_kl(student, doc, keys, values, r)
                                                                        for r in rows)
