"""Training beside a partner cartridge (`learn --beside`, TrainConfig.beside): the partner sits where composition
serves the other cartridge, the steps that get one are seeded, and the CLI writes, keeps and records its partners.
Tiny model, real HF student, real engine, real files."""

from __future__ import annotations

import json

import pytest
import torch

from cartridges_helpers import TINY
from serve_helpers import DOC_A
from final.cartridge_commands import main
from final.training.rows import read_conversations
from final.training.losses import distill_loss
from final.training.student import Student, TrainableKV
from final.training.train import TrainConfig, make_batch, partner_for, train_cartridge
from final.errors import CartridgeError
from final.models import resolve_model_path
from final.prompts import document_ids

from test_cartridges_train import data, inference  # noqa: F401  (the same module fixtures, one rule)
from test_distill_facts import DOC

OTHER = "The canal at Hollin Lock was dug in 1811. Its keeper, Ada Pell, rang a bell for every boat."


@pytest.fixture(scope="module")
def student():
    return Student(resolve_model_path(TINY))


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
    args = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "8", "--out", str(out),
            "--steps", "6", "--batch", "2", "--beside", "0.5", "--model", TINY, "--quiet"]
    assert main(args) == 0
    partners = tmp_path / "c.pt.partners.json"
    texts = json.loads(partners.read_text())
    assert len(texts) == 4 and all(t.strip() for t in texts)
    history = torch.load(tmp_path / "c.pt.ckpt", weights_only=True)["history"]
    assert {r["beside"] for r in history} == {None, "front", "behind"}  # seed 0's first six steps have all three
    manifest = json.loads((tmp_path / "c.pt.manifest.json").read_text())
    assert manifest["labels"]["beside"] == "0.5"
    before = partners.read_bytes()
    assert main(args[:-5] + ["--steps", "8"] + args[-5:]) == 0  # resumed beside the same partners
    assert partners.read_bytes() == before
    assert len(torch.load(tmp_path / "c.pt.ckpt", weights_only=True)["history"]) == 8
    capsys.readouterr()
    assert main(args + ["--beside", "2"]) != 0
    assert "beside" in capsys.readouterr().err
