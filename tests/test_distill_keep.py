"""Keeping a partner's answers (`learn --keep-partner`, final/distill/keep.py): rows about the partner's own text,
taught by the partner's cartridge alone, and trained on after both caches. Tiny model, real HF student, real files."""

from __future__ import annotations

import json

import pytest

from cartridges_helpers import TINY
from serve_helpers import DOC_A
from final.cartridge_commands import main
from final.training.learn import BESIDE, KEEP
from final.training.keep import held_sentences, keep_pick, keep_rows
from final.training.losses import distill_loss
from final.training.student import Student, TrainableKV
from final.training.train import Partner, TrainConfig, make_batch, partner_for, train
from final.errors import CartridgeError
from final.models import resolve_model_path
from final.prompts import document_ids

from test_distill_facts import DOC

PARTNER = ("The canal at Hollin Lock was dug in 1811. Its keeper, Ada Pell, rang a bell for every boat. "
           "The bell hangs there.")


@pytest.fixture(scope="module")
def student():
    return Student(resolve_model_path(TINY))


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(TINY))


def test_a_partner_is_asked_only_about_the_whole_sentences_its_cartridge_holds(tok):
    ids = document_ids(tok, PARTNER)
    whole = len(ids) - 2  # the text and its head, without the closing end-of-turn tokens
    assert held_sentences(tok, PARTNER, whole) == PARTNER
    first_two = PARTNER[:PARTNER.index(" The bell")]
    assert held_sentences(tok, PARTNER, whole - 2) == first_two  # "The bell hangs" cut: its sentence is left out
    assert held_sentences(tok, PARTNER, 5) == ""


def test_keep_rows_are_what_the_partner_alone_answers_and_our_cache_is_trained_to_leave_them(student, tok):
    pids = document_ids(tok, PARTNER)[:24]
    kv = student.prefill(pids)
    rows = keep_rows(student, tok, PARTNER, kv, 24, top_k=8)
    assert rows and all(r.seed_type == "keep" and r.target_start == 1 for r in rows)
    assert any("Hollin Lock" in r.question for r in rows) and any(r.answer == "1811" for r in rows)
    batch = make_batch(rows[:3], tok.pad_token_id, student.device)
    alone = distill_loss(student, TrainableKV(*kv, frozen_tokens=1), batch)
    assert alone.forward_kl == pytest.approx(0.0, abs=1e-5)  # the teacher is the partner alone, top-k for top-k
    ours = TrainableKV(*student.prefill(document_ids(tok, DOC_A)[:8]), frozen_tokens=1)
    own = make_batch(rows[3:5], tok.pad_token_id, student.device)  # stand-ins for our own rows
    own.beside = (*kv, False)
    plain = distill_loss(student, ours, own)
    batch.beside = own.beside
    own.keep = (batch, 2.0)
    ours.zero_grad()
    out = distill_loss(student, ours, own)
    out.loss.backward()
    assert out.keep_kl > 1e-4  # our KV beside the partner changes its answers...
    assert out.loss.item() == pytest.approx(plain.loss.item() + 2.0 * distill_loss(student, ours, batch).loss.item(),
                                            abs=1e-4)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ours.trainable_keys)  # ...and is taught not to
    assert all(t.grad is None for t in kv[0])


def test_a_steps_partner_rows_are_seeded():
    rows = list(range(10))
    assert keep_pick(rows, 3, 4, 0) == keep_pick(rows, 3, 4, 0)
    assert len(set(keep_pick(rows, 3, 4, 0))) == 4
    assert keep_pick(rows, 3, 20, 0) != rows or sorted(keep_pick(rows, 3, 20, 0)) == rows
    assert any(keep_pick(rows, s, 4, 0) != keep_pick(rows, 3, 4, 0) for s in range(4, 9))


def test_bad_keep_settings_are_named():
    for cfg in (TrainConfig(tokens=8, keep=1.0), TrainConfig(tokens=8, beside=0.5, keep=-1.0),
                TrainConfig(tokens=8, beside=0.5, keep=float("nan"))):
        with pytest.raises(CartridgeError, match="keep"):
            cfg.check()


def test_cli_learn_keep_partner_trains_on_the_partners_rows_and_records_it(tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(DOC)
    out = tmp_path / "c.pt"
    args = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "8", "--out", str(out),
            "--steps", "6", "--batch", "2", "--beside", "1", "--keep-partner", "0.5", "--model", TINY, "--quiet"]
    assert main(args) == 0
    assert json.loads((tmp_path / "c.pt.manifest.json").read_text())["labels"]["keep"] == "0.5"
    assert main(args[:-7] + ["--steps", "8"] + args[-7:]) == 0  # resumed with the same settings
    assert main(args[:-7] + ["--steps", "8", "--beside", "1", "--keep-partner", "0", "--model", TINY,
                             "--quiet"]) != 0  # another keep weight is another run: refused, named
    capsys.readouterr()
    assert main(args[:-7] + ["--steps", "8", "--beside", "0", "--keep-partner", "1", "--model", TINY,
                             "--quiet"]) != 0
    assert "keep" in capsys.readouterr().err


def test_learn_keeps_partners_answers_by_default_and_not_when_trained_alone(tmp_path):
    (tmp_path / "doc.txt").write_text(DOC)
    base = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "8", "--steps", "2", "--batch",
            "2", "--model", TINY, "--quiet"]
    assert main(base + ["--out", str(tmp_path / "a.pt")]) == 0
    labels = json.loads((tmp_path / "a.pt.manifest.json").read_text())["labels"]
    assert labels["beside"] == str(BESIDE) and labels["keep"] == str(KEEP) and KEEP > 0
    assert main(base + ["--out", str(tmp_path / "b.pt"), "--beside", "0"]) == 0  # alone: nothing to keep
    labels = json.loads((tmp_path / "b.pt.manifest.json").read_text())["labels"]
    assert "beside" not in labels and "keep" not in labels


def test_the_loop_keeps_the_rows_of_the_partner_each_step_serves(student, tok, tmp_path):
    """train(): a step beside a partner with rows trains on half a batch of them (its record has keep_kl); a step
    alone, or beside a partner without rows, has none."""
    rows_of = {}
    partners = []
    for text in (PARTNER, DOC_A):
        kv = student.prefill(document_ids(tok, text)[:24])
        rows_of[text] = keep_rows(student, tok, text, kv, 24, top_k=8)
        partners.append(Partner(*kv, rows_of[text] if text == PARTNER else ()))
    ours = TrainableKV(*student.prefill(document_ids(tok, DOC)[:8]), frozen_tokens=1)
    convs = rows_of[DOC_A]  # any scored rows stand in for our own
    cfg = TrainConfig(tokens=8, steps=12, batch=2, beside=0.75, keep=1.0)
    history = train(student, ours, convs, cfg, tok.pad_token_id, tmp_path / "c.ckpt", progress=False,
                    log=lambda _: None, partners=partners)
    for step, rec in enumerate(history):
        picked = partner_for(step, cfg, partners)
        assert ("keep_kl" in rec) == (picked is not None and picked[0] is partners[0])
    assert any("keep_kl" in rec for rec in history) and any("keep_kl" not in rec for rec in history)
