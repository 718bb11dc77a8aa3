"""Matching the teacher's hidden states (final/distill/hidden.py, `learn --hidden W`) on the tiny model: the teacher's
states are the model's own over the document and the row in one pass; a cartridge that is the document's whole KV
has none of the error, a shorter one has some; the error is whitened per dimension; training lowers it and records
it; its weight is checked, needs the document and is part of what a resume must match."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from cartridges_helpers import TINY
from serve_helpers import DOC_A
from final.cartridge_commands import main
from final.training import hidden
from final.training.document.facts import FactConfig, fact_prompts
from final.training.teacher import teacher_window, token_offsets, token_range
from final.training.hidden import HiddenTeacher, WindowTeacher, hidden_error, layer_states
from final.training.learn import HIDDEN
from final.training.losses import distill_loss
from final.training.student import TrainableKV
from final.training.train import TrainConfig, make_batch, train, train_cartridge
from final.errors import CartridgeError
from final.prompts import document_ids

from test_cartridges_train import data, inference  # noqa: F401 - the tiny engine and its self-study rows
from test_distill_facts import DOC
from test_distill_keep import student, tok  # noqa: F401 - the tiny student and tokenizer fixtures

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


def test_a_windowed_rows_teacher_is_its_own_window_found_again_from_the_row(student, tok, monkeypatch):
    offsets = token_offsets(tok, DOC)
    # a row about the document's first sentence and one about its last, as `learn --teacher-tokens 16` makes them
    prompts = fact_prompts(DOC, FactConfig(teacher_tokens=16))
    rows = [SimpleNamespace(chunk=token_range(offsets, fp.span)) for fp in (prompts[0], prompts[-1])]
    windows = [teacher_window(tok, DOC, fp.span, 16) for fp in (prompts[0], prompts[-1])]
    assert windows[0] != windows[1]
    monkeypatch.setattr(hidden, "KEPT_WINDOWS", 1)  # a window dropped is prefilled again, the same
    teacher = WindowTeacher(student, tok, DOC, 16)
    theirs = teacher.states(ROWS, WHERE, rows)
    assert len(teacher.kept) == 1
    torch.testing.assert_close(theirs, teacher.states(ROWS, WHERE, rows))
    for r, window in enumerate(windows):  # each row after the window its KL targets were scored after
        own = HiddenTeacher(student, document_ids(tok, window)).states(ROWS[r:r + 1], WHERE[r:r + 1])
        before, n = int(WHERE[:r].sum()), int(WHERE[r].sum())
        for mine, full in zip(theirs, own):
            torch.testing.assert_close(mine[before:before + n], full, atol=2e-4, rtol=2e-4)
    whole = HiddenTeacher(student, document_ids(tok, DOC)).states(ROWS, WHERE)
    assert float(hidden_error(theirs, whole)) > 1e-3
    calls, real = [], student.states  # rows that share a window share its forward, their states in row order
    monkeypatch.setattr(student, "states", lambda *a, **kw: calls.append(len(a[2])) or real(*a, **kw))
    got = teacher.states(torch.cat([ROWS, ROWS[:1]]), torch.cat([WHERE, WHERE[:1]]), rows + rows[:1])
    assert sorted(calls) == [1, 2]
    both = int(WHERE.sum())
    for mine, each in zip(got, theirs):
        torch.testing.assert_close(mine[:both], each, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(mine[both:], each[:int(WHERE[0].sum())], atol=2e-4, rtol=2e-4)
    with pytest.raises(CartridgeError) as err:  # rows made from a longer document
        teacher.states(ROWS, WHERE, [SimpleNamespace(chunk=(0, 1)), SimpleNamespace(chunk=(3, 900))])
    assert err.value.field == "chunk"


def test_tiled_rows_are_taught_and_matched_after_their_tile(student, tok, tmp_path):
    doc = " ".join([DOC] * 3)
    offsets = token_offsets(tok, doc)
    prompts = fact_prompts(doc, FactConfig(teacher_tokens=64, teacher_tiles=True))
    teacher = WindowTeacher(student, tok, doc, 64, tiled=True)
    for fp in prompts:  # the hidden states' teacher finds again, from the row's chunk, the tile its KL came from
        chunk = token_range(offsets, fp.span)
        assert teacher._window_text(chunk) == teacher_window(tok, doc, fp.span, 64, offsets, tiled=True)
    (tmp_path / "doc.txt").write_text(doc)
    args = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "8", "--out",
            str(tmp_path / "c.pt"), "--batch", "2", "--beside", "0", "--model", TINY, "--quiet", "--steps", "2",
            "--teacher-tokens", "64", "--teacher-tiles", "--hidden", "1"]
    assert main(args) == 0
    made = json.loads((tmp_path / "c.pt.facts.jsonl.json").read_text())
    assert made["facts"]["teacher_tiles"] is True
    assert main(args[:-5] + ["--teacher-tokens", "64", "--hidden", "1"]) != 0  # the rows were taught by tiles


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
    from final.training.rows import read_conversations

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
    from final.training.rows import read_conversations

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


def test_cli_learn_hidden_is_labelled_resumes_only_at_its_weight_and_matches_windows(tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(DOC)
    args = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "8", "--out",
            str(tmp_path / "c.pt"), "--batch", "2", "--beside", "0", "--model", TINY, "--quiet"]
    assert main(args + ["--steps", "2", "--hidden", "1"]) == 0
    assert json.loads((tmp_path / "c.pt.manifest.json").read_text())["labels"]["hidden"] == "1.0"
    assert main(args + ["--steps", "3", "--hidden", "1"]) == 0  # resumed with the same weight
    capsys.readouterr()
    assert main(args + ["--steps", "4", "--hidden", "2"]) != 0  # another weight is another run
    assert "hidden" in capsys.readouterr().err
    windows = ["--teacher-tokens", "16", "--steps", "1"]
    assert main(args[:6] + args[8:] + windows + ["--out", str(tmp_path / "w.pt")]) == 0  # the windows' default
    assert "hidden" not in json.loads((tmp_path / "w.pt.manifest.json").read_text())["labels"]
    assert main(args[:6] + args[8:] + windows + ["--out", str(tmp_path / "v.pt"), "--hidden", "1"]) == 0
    assert json.loads((tmp_path / "v.pt.manifest.json").read_text())["labels"]["hidden"] == "1.0"


def test_cli_learn_matches_hidden_states_by_default(tmp_path):
    (tmp_path / "doc.txt").write_text(DOC)
    args = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "8", "--batch", "2", "--beside",
            "0", "--model", TINY, "--quiet", "--steps", "1"]
    assert main(args + ["--out", str(tmp_path / "c.pt")]) == 0
    assert json.loads((tmp_path / "c.pt.manifest.json").read_text())["labels"]["hidden"] == str(HIDDEN)
    assert main(args + ["--out", str(tmp_path / "d.pt"), "--hidden", "0"]) == 0
    assert "hidden" not in json.loads((tmp_path / "d.pt.manifest.json").read_text())["labels"]


def test_kept_states_are_the_teachers_computed_once_a_row_in_any_batch(student, tok, monkeypatch):
    from final.training.hidden import KeptStates

    teacher = HiddenTeacher(student, document_ids(tok, DOC))
    calls = []
    original = teacher.states
    monkeypatch.setattr(teacher, "states", lambda ids, where, rows=(): calls.append(len(ids)) or original(ids, where))
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
    sampled = KeptStates(teacher)  # on-policy rows (`--on-policy`) are new each step: not kept, filling the budget
    sampled.states(ROWS, WHERE, [SimpleNamespace(sampled=True), SimpleNamespace(sampled=False)])
    assert len(sampled.kept) == 1 and calls == [2, 2, 2, 2]
