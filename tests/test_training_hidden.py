"""Matching the teacher's hidden states (final/training/hidden.py, `learn`'s `hidden` setting) on the tiny model: the teacher's
states are the model's own over the document and the row in one pass; a cartridge that is the document's whole KV
has none of the error, a shorter one has some; the error is whitened per dimension; training lowers it and records
it; its weight is checked, needs the document and is part of what a resume must match."""

from __future__ import annotations

import json

import pytest
import torch

from cartridges_helpers import TINY
from serve_helpers import DOC_A
from final.cartridge_commands import main
from final.errors import CartridgeError
from final.prompts import document_ids
from final.training.hidden import HiddenTeacher, KeptStates, hidden_error, layer_states
from final.training.learn import HIDDEN
from final.training.losses import distill_loss
from final.training.rows import read_conversations
from final.training.settings import TrainConfig
from final.training.student import TrainableKV
from final.training.train import make_batch, train, train_cartridge

from training_helpers import DOC, data, inference, settings, student, tok  # noqa: F401 - the tiny engine, rows, student


ROWS = torch.tensor([[1, 4093, 198, 1780, 314, 1137, 563, 2, 0], [1, 4093, 198, 50, 723, 94, 1077, 39365, 2]])
WHERE = torch.tensor([[True] * 8 + [False], [True] * 9])  # the first row's last token is padding


def test_teacher_states_are_the_models_own_over_the_document_and_the_row(student, tok):
    doc = document_ids(tok, DOC)
    theirs = HiddenTeacher(student, doc).states(ROWS, WHERE)
    for r, row in enumerate(ROWS):
        n = int(WHERE[r].sum())
        out = student.model.model(torch.tensor([doc + row[:n].tolist()]), output_hidden_states=True)
        whole = layer_states(out)
        assert len(whole) == len(theirs) == student.model.config.num_hidden_layers
        before = int(WHERE[:r].sum())
        for mine, full in zip(theirs, whole):
            torch.testing.assert_close(mine[before:before + n], full[0, len(doc):], atol=2e-4, rtol=2e-4)


def test_a_cartridge_that_is_the_whole_document_has_no_error_and_a_shorter_one_has(student, tok):
    doc = document_ids(tok, DOC)
    theirs = HiddenTeacher(student, doc).states(ROWS, WHERE)
    keys, values = student.prefill(doc)
    logq, mine = student.log_probs(keys, values, ROWS, WHERE, hidden=True)
    assert float(hidden_error(mine, theirs)) < 1e-6
    torch.testing.assert_close(logq, student.log_probs(keys, values, ROWS, WHERE))  # the logits read the last state
    keys, values = student.prefill(doc[:8])
    assert float(hidden_error(student.log_probs(keys, values, ROWS, WHERE, hidden=True)[1], theirs)) > 1e-3


def test_the_error_is_measured_in_each_dimensions_own_spread():
    g = torch.Generator().manual_seed(0)
    theirs = torch.randn(64, 2, generator=g) * torch.tensor([100.0, 1.0])  # a massive dimension beside a small one
    off_big, off_small = theirs + torch.tensor([1.0, 0.0]), theirs + torch.tensor([0.0, 1.0])
    assert float(hidden_error([off_small], [theirs])) > 100 * float(hidden_error([off_big], [theirs]))
    assert float(hidden_error([theirs], [theirs])) == 0.0
    assert torch.isfinite(hidden_error([theirs[:1] + 1], [theirs[:1]]))  # one position: no spread, a floor


def test_the_term_adds_to_the_loss_at_its_weight(student, tok, data):  # noqa: F811
    rows = read_conversations(data, student.vocab_size)
    doc = document_ids(tok, DOC_A)  # the rows' document
    cache = TrainableKV(*student.prefill(doc[:8]), frozen_tokens=1)
    batch = make_batch(rows[:2], tok.eos_token_id, student.device)
    plain = distill_loss(student, cache, batch)
    batch.hidden = (HiddenTeacher(student, doc).states(batch.ids, batch.where), 3.0)
    weighed = distill_loss(student, cache, batch)
    assert plain.hidden is None and weighed.hidden > 0
    assert weighed.loss.item() == pytest.approx(plain.loss.item() + 3.0 * weighed.hidden, rel=1e-5)


def test_training_lowers_the_error_and_records_it(student, tok, data, tmp_path):  # noqa: F811
    rows = read_conversations(data, student.vocab_size)[:2]
    doc = document_ids(tok, DOC_A)
    cache = TrainableKV(*student.prefill(doc[:8]), frozen_tokens=1)
    cfg = TrainConfig(tokens=8, steps=8, batch=2, lr=5e-2, hidden=10.0)  # every step the same two rows
    history = train(student, cache, rows, cfg, tok.eos_token_id, tmp_path / "c.ckpt", progress=False,
                    log=lambda _: None, teacher=HiddenTeacher(student, doc))
    assert history[-1]["hidden"] < 0.9 * history[0]["hidden"]  # 1.55 -> 1.33 (a random tiny model)
    with pytest.raises(CartridgeError) as err:
        train(student, cache, rows, cfg, tok.eos_token_id, tmp_path / "d.ckpt", progress=False)
    assert err.value.field == "hidden"  # the weight without the document's teacher


def test_the_weight_is_checked_and_needs_the_document(data, tmp_path):  # noqa: F811
    for bad in (-1.0, float("nan")):
        with pytest.raises(CartridgeError) as err:
            TrainConfig(tokens=8, hidden=bad).check()
        assert err.value.field == "hidden"
    with pytest.raises(CartridgeError) as err:
        train_cartridge(TINY, data, tmp_path / "c.pt", TrainConfig(tokens=8, steps=1, batch=2, hidden=1.0),
                        progress=False)
    assert err.value.field == "hidden"


def test_cli_learn_hidden_is_labelled_resumes_only_at_its_weight(tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(DOC)
    args = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "8", "--out",
            str(tmp_path / "c.pt"), "--model", TINY, "--quiet"]
    weight = lambda w: settings(tmp_path, f"batch: 2\nbeside: 0\nhidden: {w}\n")  # noqa: E731
    assert main(args + ["--steps", "2", *weight(1)]) == 0
    assert json.loads((tmp_path / "c.pt.manifest.json").read_text())["labels"]["hidden"] == "1.0"
    assert main(args + ["--steps", "3", *weight(1)]) == 0  # resumed with the same weight
    capsys.readouterr()
    assert main(args + ["--steps", "4", *weight(2)]) != 0  # another weight is another run
    assert "hidden" in capsys.readouterr().err
    windows = ["--teacher-tokens", "16", "--steps", "1", "--out", str(tmp_path / "w.pt")]
    assert main(args[:-5] + ["--model", TINY, "--quiet", *windows, *settings(tmp_path, "batch: 2\n")]) == 0
    assert "hidden" not in json.loads((tmp_path / "w.pt.manifest.json").read_text())["labels"]  # windows: off


def test_cli_learn_matches_hidden_states_by_default(tmp_path):
    (tmp_path / "doc.txt").write_text(DOC)
    args = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "8", "--model", TINY, "--quiet",
            "--steps", "1"]
    assert main(args + ["--out", str(tmp_path / "c.pt"), *settings(tmp_path, "batch: 2\nbeside: 0\n")]) == 0
    assert json.loads((tmp_path / "c.pt.manifest.json").read_text())["labels"]["hidden"] == str(HIDDEN)
    assert main(args + ["--out", str(tmp_path / "d.pt"), *settings(tmp_path, "batch: 2\nbeside: 0\nhidden: 0\n")]) == 0
    assert "hidden" not in json.loads((tmp_path / "d.pt.manifest.json").read_text())["labels"]


def test_kept_states_are_the_teachers_computed_once_a_row_in_any_batch(student, tok, monkeypatch):
    teacher = HiddenTeacher(student, document_ids(tok, DOC))
    calls = []
    original = teacher.states
    monkeypatch.setattr(teacher, "states", lambda ids, where: calls.append(len(ids)) or original(ids, where))
    kept = KeptStates(teacher)
    both = kept.states(ROWS, WHERE)
    torch.testing.assert_close(both, original(ROWS, WHERE), atol=2e-4, rtol=2e-4)
    # the second row alone, the two swapped, the first padded wider: read back, no forward
    second = kept.states(ROWS[1:], WHERE[1:])
    n = int(WHERE[0].sum())
    torch.testing.assert_close(second, [h[n:] for h in both])
    swapped = kept.states(ROWS.flip(0), WHERE.flip(0))
    torch.testing.assert_close(swapped, [torch.cat([h[n:], h[:n]]) for h in both])
    wide = torch.cat([ROWS[:1], torch.zeros((1, 3), dtype=torch.long)], 1)
    torch.testing.assert_close(kept.states(wide, torch.cat([WHERE[:1], torch.zeros((1, 3), dtype=torch.bool)], 1)),
                               [h[:n] for h in both])
    assert calls == [2]
    full = KeptStates(teacher, budget=0)  # nothing kept past the budget: computed each time, the same
    torch.testing.assert_close(full.states(ROWS, WHERE), both, atol=2e-4, rtol=2e-4)
    full.states(ROWS, WHERE)
    assert calls == [2, 2, 2] and not full.kept
