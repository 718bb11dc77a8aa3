"""Fact rows (final/training/document/facts.py) and `final cartridge learn`: every sentence asked about, answered
from the document, scored by the real teacher (tiny model, real engine); the command trains a cartridge from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cartridges_helpers import TINY
from final.cartridge_commands import main
from final.errors import CartridgeError
from final.training import learn
from final.training.document.facts import cues, fact_prompts, fact_rows, names
from final.training.document.sentences import sentences, unwrap
from final.training.settings import FactConfig
from final.training.teacher import ChunkContext, teacher_system, teacher_window

from training_helpers import DOC, inference, settings  # noqa: F401  (the module's engine fixture)

ROOT = Path(__file__).resolve().parents[1]


def test_sentences_split_at_end_marks_and_line_breaks_and_keep_the_text():
    spans = sentences(DOC)
    assert [DOC[a:b] for a, b in spans] == [
        "Brennock Ferry is a small town on the Sallow River.", "It was founded in 1742 by Odo Brennock.",
        "Today the town has roughly 6,300 people.", "The first settlement had eleven households.",
        "The mill closed in 1903!", "Was it rebuilt?", "Nobody knows."]


def test_cues_are_names_and_numbers_not_sentence_openers():
    known = names(DOC)
    assert cues("Brennock Ferry is a small town on the Sallow River.", known) == ["Brennock Ferry", "Sallow River"]
    assert cues("It was founded in 1742 by Odo Brennock.", known) == ["1742", "Odo Brennock"]
    assert cues("Today the town has roughly 6,300 people.", known) == ["6,300"]  # "Today" is no name
    assert cues("The first settlement had eleven households.", known) == ["eleven"]
    assert cues("Nobody knows.", known) == []


def test_every_sentence_is_asked_about_and_answers_come_from_the_document():
    prompts = fact_prompts(DOC, FactConfig())
    spans = sentences(DOC)
    quoted = {fp.span[0] for fp in prompts if fp.kind == "quote"}
    assert quoted == {a for a, _ in spans}  # a sentence without cues is asked about by its opening words
    read = unwrap(DOC)  # the document as rows read it: its one wrapped line break a space (test_distill_sentences)
    assert read == DOC.replace("Brennock.\nToday", "Brennock. Today")
    for fp in prompts:
        assert fp.answer in read
        if fp.kind == "cloze":
            sentence = read[fp.span[0]:fp.span[1]]
            assert "___" in fp.question and fp.answer in sentence
            assert fp.question.count("___") == 1 and sentence.replace(fp.answer, "___", 1) in fp.question
        else:
            assert fp.answer.startswith(read[fp.span[0]:fp.span[1]])  # the sentence and the next
    assert {fp.answer for fp in prompts if fp.kind == "cloze"} >= {"1742", "Odo Brennock", "6,300", "eleven",
                                                                   "Sallow River", "1903"}


def test_the_teacher_window_holds_the_span_and_has_the_asked_length(inference):
    tok = inference.tokenizer
    start = DOC.index("The mill")
    span = (start, start + len("The mill closed in 1903!"))
    for n in (4, 12, 10_000):
        window = teacher_window(tok, DOC, span, n)
        assert DOC[span[0]:span[1]] in window and window in DOC
        if n < len(tok(DOC, add_special_tokens=False).input_ids):
            assert len(tok(window, add_special_tokens=False).input_ids) <= max(n, 12)
    assert teacher_window(tok, DOC, span, 10_000) == DOC


@pytest.mark.parametrize("window", [None, 16])
def test_fact_rows_carry_the_teachers_scores_of_the_documents_answers(inference, window):
    cfg = FactConfig(teacher_tokens=window, top_k=4)
    rows = fact_rows(inference, DOC, cfg)
    tok = inference.tokenizer
    prompts = fact_prompts(DOC, cfg)
    assert len(rows) == len(prompts)
    i = next(i for i, fp in enumerate(prompts) if fp.kind == "cloze")
    row = rows[i]
    assert tok.decode(row.answer_ids[:-1]) == row.answer and row.target_start == 1
    assert len(row.top_ids) == len(row.prompt_ids) + len(row.answer_ids) - 1
    system = teacher_system(DOC) if window is None else teacher_window(tok, DOC, prompts[i].span, 16)
    with ChunkContext(inference, system, "__check") as ctx:
        (tops, _), = ctx.teacher_scores([row.prompt_ids], [row.answer_ids], 4)
    assert [[t for t, _ in top] for top in tops] == row.top_ids
    assert all(abs(a - b) < 1e-4 for top, lps in zip(tops, row.top_logprobs) for (_, a), b in zip(top, lps))


def test_bad_fact_settings_are_named():
    with pytest.raises(CartridgeError, match="teacher_tokens"):
        FactConfig(teacher_tokens=3).check()
    with pytest.raises(CartridgeError, match="quote_sentences"):
        FactConfig(quote_sentences=0).check()
    with pytest.raises(CartridgeError, match="top_k"):
        FactConfig(top_k=0).check()


def test_cli_learn_writes_rows_and_a_trained_cartridge_and_resumes(tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(DOC)
    out = tmp_path / "c.pt"
    args = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "8", "--out", str(out),
            "--steps", "2", "--model", TINY, "--quiet", *settings(tmp_path, "batch: 2\n")]
    assert main(args) == 0
    data = tmp_path / "c.pt.facts.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert {r["seed_type"] for r in rows} == {"quote", "cloze"} and out.is_file()
    manifest = json.loads((tmp_path / "c.pt.manifest.json").read_text())
    assert manifest["num_tokens"] == 8 and manifest["source_document"] == str(tmp_path / "doc.txt")
    assert "fact rows" in capsys.readouterr().out
    before = data.read_bytes()
    assert main(args) == 0  # the rows a checkpoint was trained on are kept, not rewritten
    assert data.read_bytes() == before and "fact rows" not in capsys.readouterr().out
    # rows made with other settings (or from another document) are refused, not trained on
    assert main(args + settings(tmp_path, "batch: 2\ntop_k: 4\n")) != 0
    assert "facts differ" in capsys.readouterr().err
    for bad, key in (("hidden: -1\n", "hidden"), ("fact_kinds: cloze\n", "fact_kinds"), ("steps: 4\n", "steps")):
        assert main(args + settings(tmp_path, bad)) != 0  # out of range; a setting removed; a flag's
        assert f"'{key}'" in capsys.readouterr().err
    assert main(args + ["--teacher-tokens", "16"] + settings(tmp_path, "hidden: 1\n")) != 0  # windows' states
    assert "hidden" in capsys.readouterr().err
    (tmp_path / "doc.txt").write_text(DOC + " A new sentence.")
    assert main(args) != 0
    assert "text_sha256 differ" in capsys.readouterr().err
    assert main(["cartridge", "learn", "--text", str(tmp_path / "none.txt"), "--tokens", "8", "--out",
                 str(tmp_path / "d.pt"), "--model", TINY]) != 0


def test_learn_notes_a_long_document_taught_whole_and_not_in_windows(tmp_path, capsys, monkeypatch):
    """Past LONG_DOCUMENT tokens the whole-document teacher costs several times the windows' (bench/RESULTS.md):
    `learn` says so before it starts, and not when --teacher-tokens is given or the document is short."""
    (tmp_path / "doc.txt").write_text(DOC)
    alone = settings(tmp_path, "batch: 2\nbeside: 0\n")
    args = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "8", "--out",
            str(tmp_path / "c.pt"), "--steps", "1", "--model", TINY, "--quiet", *alone]
    assert main(args) == 0
    assert "note:" not in capsys.readouterr().err  # the real threshold: DOC is far below it
    monkeypatch.setattr(learn, "LONG_DOCUMENT", 16)
    (tmp_path / "c.pt").unlink()
    (tmp_path / "c.pt.ckpt").unlink(missing_ok=True)
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "note:" in err and "--teacher-tokens 256" in err and "doc.txt" in err
    assert main(["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "8", "--out",
                 str(tmp_path / "w.pt"), "--steps", "1", "--model", TINY, "--quiet", *alone,
                 "--teacher-tokens", "16"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_learn_refuses_a_document_it_cannot_read_or_shorter_than_the_cartridge_naming_the_flag(tmp_path, capsys):
    """A document that, with a fact row after it, is past the model's context window (the tiny model's 4,096; the
    shipped 6.7k-token skarrow) is refused before any row is written - the file and field named, and the flag
    that reads it in windows - instead of failing inside the rows with an internal cartridge's name."""
    doc = ROOT / "data" / "qa" / "skarrow.txt"
    base = ["cartridge", "learn", "--text", str(doc), "--tokens", "8", "--steps", "1", "--model", TINY, "--quiet"]
    for extra, fix in (([], "--teacher-tokens 256"), (["--teacher-tokens", "256", "--init", "match"],
                                                       "--init prefix")):
        assert main([*base, "--out", str(tmp_path / "c.pt"), *extra]) == 2
        err = capsys.readouterr().err
        assert str(doc) in err and "'text'" in err and "context window of 4,096" in err and fix in err
        assert list(tmp_path.iterdir()) == []  # nothing written
    short = tmp_path / "short" / "doc.txt"  # shorter than the cartridge asked for: refused, naming --tokens
    short.parent.mkdir()
    short.write_text("The ferry was founded in 1742.")
    assert main(["cartridge", "learn", "--text", str(short), "--tokens", "64", "--out", str(tmp_path / "s.pt"),
                 "--model", TINY, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "'tokens'" in err and "fewer than --tokens 64" in err and str(short) in err
    assert list(tmp_path.iterdir()) == [short.parent]
