"""Training for cartridges served together (final/training/compose.py; `learn`'s settings `beside`, `keep_partner`):
a partner cartridge sits where composition serves the other one, the steps that get one are seeded, the partner's
own rows are kept as it alone answers them, and the CLI writes, keeps and records its partners. Tiny model, real HF
student, real engine, real files."""

from __future__ import annotations

import json

import pytest
import torch

from cartridges_helpers import TINY
from serve_helpers import DOC_A
from final.cartridge_commands import main
from final.errors import CartridgeError
from final.prompts import document_ids
from final.training.compose import held_sentences, keep_pick, keep_rows
from final.training.learn import KEEP
from final.training.losses import distill_loss
from final.training.rows import read_conversations
from final.training.settings import LearnSettings, TrainConfig
from final.training.student import TrainableKV
from final.training.train import Partner, make_batch, partner_for, train, train_cartridge

from training_helpers import DOC, data, inference, settings, student, tok  # noqa: F401  (the module's fixtures)

OTHER = "The canal at Hollin Lock was dug in 1811. Its keeper, Ada Pell, rang a bell for every boat."
PARTNER = OTHER + " The bell hangs there."


def test_a_partner_is_served_where_composition_puts_the_other_cartridge(inference, data, student):
    """Beside a partner, the student reads the two caches concatenated in that order (as `cartridge=[a, b]` is
    served), with the prompt after both; the gradient reaches the trained cache and not the partner."""
    tok = inference.tokenizer
    rows = read_conversations(data, len(tok))[:2]
    ours = TrainableKV(*student.prefill(document_ids(tok, DOC_A)[:8]), frozen_tokens=1)
    pk, pv = student.prefill(document_ids(tok, OTHER)[:6])
    keys, values = ours.full()
    for front in (True, False):
        pair = (lambda t, o: torch.cat([t, o], 2)) if front else (lambda t, o: torch.cat([o, t], 2))
        joined = TrainableKV([pair(t, o) for t, o in zip(pk, keys)], [pair(t, o) for t, o in zip(pv, values)], 1)
        batch = make_batch(rows, tok.pad_token_id, student.device)
        reference = distill_loss(student, joined, batch)
        batch.beside = (pk, pv, front)
        ours.zero_grad()
        out = distill_loss(student, ours, batch)
        out.loss.backward()
        assert out.loss.item() == pytest.approx(reference.loss.item(), abs=1e-5)
        assert out.forward_kl == pytest.approx(reference.forward_kl, abs=1e-5)
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ours.trainable_keys)
        assert all(t.grad is None for t in pk)
    alone = distill_loss(student, ours, make_batch(rows, tok.pad_token_id, student.device))
    assert abs(alone.loss.item() - reference.loss.item()) > 1e-4  # the partner changes what the student reads


def test_the_steps_beside_a_partner_are_a_seeded_share_in_both_orders():
    partners = ["a", "b", "c"]
    cfg = TrainConfig(tokens=8, beside=0.5, seed=3)
    picks = [partner_for(step, cfg, partners) for step in range(400)]
    assert picks == [partner_for(step, cfg, partners) for step in range(400)]  # a resume trains beside the same
    chosen = [p for p in picks if p is not None]
    assert 0.4 < len(chosen) / len(picks) < 0.6
    assert {p for p, _ in chosen} == set(partners) and {front for _, front in chosen} == {True, False}
    assert all(partner_for(s, TrainConfig(tokens=8), partners) is None for s in range(50))
    assert all(partner_for(s, TrainConfig(tokens=8, beside=1.0), partners) for s in range(50))
    assert all(partner_for(s, cfg, []) is None for s in range(50))


def test_bad_beside_settings_are_named(data, tmp_path):
    with pytest.raises(CartridgeError, match="beside"):
        TrainConfig(tokens=8, beside=1.5).check()
    with pytest.raises(CartridgeError, match="beside"):  # a share of steps beside nothing
        train_cartridge(TINY, data, tmp_path / "c.pt", TrainConfig(tokens=8, steps=1, beside=0.5), text=DOC_A,
                        progress=False)


def test_cli_learn_beside_writes_its_partners_trains_beside_them_and_resumes(tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(DOC)
    out = tmp_path / "c.pt"
    base = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "8", "--out", str(out),
            "--model", TINY, "--quiet", *settings(tmp_path, "batch: 2\nbeside: 0.5\n")]
    args = base + ["--steps", "6"]
    assert main(args) == 0
    partners = tmp_path / "c.pt.partners.json"
    texts = json.loads(partners.read_text())
    assert len(texts) == 4 and all(t.strip() for t in texts)
    history = torch.load(tmp_path / "c.pt.ckpt", weights_only=True)["history"]
    assert {r["beside"] for r in history} == {None, "front", "behind"}  # seed 0's first six steps have all three
    manifest = json.loads((tmp_path / "c.pt.manifest.json").read_text())
    assert manifest["labels"]["beside"] == "0.5"
    before = partners.read_bytes()
    assert main(base + ["--steps", "8"]) == 0  # resumed beside the same partners
    assert partners.read_bytes() == before
    assert len(torch.load(tmp_path / "c.pt.ckpt", weights_only=True)["history"]) == 8
    capsys.readouterr()
    assert main(args + settings(tmp_path, "beside: 2\n")) != 0
    assert "beside" in capsys.readouterr().err


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
            "--model", TINY, "--quiet"]
    keep = lambda beside, w: settings(tmp_path, f"batch: 2\nbeside: {beside}\nkeep_partner: {w}\n")  # noqa: E731
    assert main(args + ["--steps", "6", *keep(1, 0.5)]) == 0
    assert json.loads((tmp_path / "c.pt.manifest.json").read_text())["labels"]["keep"] == "0.5"
    assert main(args + ["--steps", "8", *keep(1, 0.5)]) == 0  # resumed with the same settings
    assert main(args + ["--steps", "8", *keep(1, 0)]) != 0  # another keep weight is another run: refused, named
    capsys.readouterr()
    assert main(args + ["--steps", "8", *keep(0, 1)]) != 0
    assert "keep" in capsys.readouterr().err


def test_learn_keeps_partners_answers_by_default_and_not_when_trained_alone(tmp_path):
    (tmp_path / "doc.txt").write_text(DOC)
    base = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "8", "--steps", "2",
            "--model", TINY, "--quiet"]
    assert main(base + ["--out", str(tmp_path / "a.pt"), *settings(tmp_path, "batch: 2\n")]) == 0
    labels = json.loads((tmp_path / "a.pt.manifest.json").read_text())["labels"]
    assert labels["beside"] == str(LearnSettings.beside) and labels["keep"] == str(KEEP) and KEEP > 0
    alone = settings(tmp_path, "batch: 2\nbeside: 0\n")  # alone: nothing to keep
    assert main(base + ["--out", str(tmp_path / "b.pt"), *alone]) == 0
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
