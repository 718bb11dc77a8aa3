"""Fact rows (final/distill/facts.py) and `final cartridge learn`: every sentence asked about, answered from the
document, scored by the real teacher (tiny model, real engine); the command trains a cartridge from them."""

from __future__ import annotations

import json

import pytest

from cartridges_helpers import TINY
from final.cartridge_commands import main
from final.training.document.facts import FactConfig, cues, fact_prompts, fact_rows, names, teacher_systems
from final.training.teacher import teacher_window, tile_start, token_offsets
from final.training.document.sentences import sentences, unwrap
from final.errors import CartridgeError

from test_cartridges_train import inference  # noqa: F401  (the module's engine fixture)

DOC = ("Brennock Ferry is a small town on the Sallow River. It was founded in 1742 by Odo Brennock.\n"
       "Today the town has roughly 6,300 people. The first settlement had eleven households.\n\n"
       "The mill closed in 1903! Was it rebuilt? Nobody knows.")


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
    only = fact_prompts(DOC, FactConfig(kinds=("cloze",)))
    assert only and all(fp.kind == "cloze" for fp in only)


def test_cloze_context_quotes_the_sentences_before_the_blank_so_a_pronoun_has_its_subject():
    plain = {fp.answer: fp for fp in fact_prompts(DOC, FactConfig(kinds=("cloze",)))}
    wide = {fp.answer: fp for fp in fact_prompts(DOC, FactConfig(kinds=("cloze",), cloze_context=1))}
    assert plain.keys() == wide.keys()
    assert "Brennock Ferry" not in plain["1742"].question  # "It was founded in ___ by Odo Brennock."
    assert ('"Brennock Ferry is a small town on the Sallow River. It was founded in ___ by Odo Brennock."'
            in wide["1742"].question)
    assert DOC[slice(*wide["1742"].span)] == DOC[:DOC.index("Odo Brennock.") + len("Odo Brennock.")]
    first = wide["Sallow River"]  # the first sentence has nothing before it
    assert first.question == plain["Sallow River"].question and first.span == plain["Sallow River"].span
    with pytest.raises(CartridgeError, match="cloze_context"):
        FactConfig(cloze_context=-1).check()


def test_ask_rows_turn_each_cue_into_a_question_word_and_stop_at_its_clause():
    asked = {a: q for a, q in [(p.answer, p.question) for p in fact_prompts(DOC, FactConfig(kinds=("ask",)))]}
    assert asked["eleven"] == "The first settlement had how many households?"
    assert asked["1742"] == "It was founded in which year by Odo Brennock?"
    assert asked["Odo Brennock"] == "It was founded in 1742 by what?"
    assert asked["Brennock Ferry"] == "What is a small town on the Sallow River?"  # the subject: what it is
    assert asked["6,300"] == "Today the town has roughly how many people?"  # a comma inside a number ends nothing
    assert asked["Sallow River"] == "Brennock Ferry is a small town on the what?"
    assert all(p.kind == "ask" and p.question.endswith("?") for p in fact_prompts(DOC, FactConfig(kinds=("ask",))))


def test_word_rows_blank_the_ordinary_words_a_fact_hangs_on_nouns_first():
    prompts = fact_prompts(DOC, FactConfig(kinds=("word",)))
    assert prompts and all(fp.kind == "word" for fp in prompts)
    for fp in prompts:
        sentence = DOC[fp.span[0]:fp.span[1]]
        assert fp.answer.islower() and fp.question.count("___") == 1
        assert any(sentence[:m] + "___" + sentence[m + len(fp.answer):] in fp.question
                   for m in range(len(sentence)) if sentence.startswith(fp.answer, m))
    by_sentence: dict = {}
    for fp in prompts:
        by_sentence.setdefault(DOC[fp.span[0]:fp.span[1]], []).append(fp.answer)
    # a noun (after an article, a number or a number word) before a verb; the rarer first
    assert by_sentence["Today the town has roughly 6,300 people."] == ["people", "town"]
    assert by_sentence["The first settlement had eleven households."] == ["households", "settlement"]
    assert by_sentence["The mill closed in 1903!"] == ["mill", "closed"]
    answers = {fp.answer for fp in prompts}
    # never a cue (a number word has its cloze row), an adverb, a plain word, or a word the document repeats
    assert not answers & {"eleven", "roughly", "first", "the", "is", "was"}
    assert "town" not in {fp.answer for fp in fact_prompts(DOC + " The town is old.", FactConfig(kinds=("word",)))}
    one = fact_prompts(DOC, FactConfig(kinds=("word",), words=1))
    assert len(one) == len(by_sentence) and {fp.answer for fp in one} >= {"people", "households", "mill"}
    with pytest.raises(CartridgeError, match="words"):
        FactConfig(kinds=("word",), words=0).check()


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


def test_tiles_overlap_by_half_and_each_span_gets_the_one_it_sits_nearest_the_middle_of():
    # 100 tokens in tiles of 40: starts 0, 20, 40, 60 (the last ends at the document's end)
    assert tile_start(100, 32, 36, 40) == 20  # 20..60 has 32..36 nearer its middle than 0..40 has
    assert tile_start(100, 25, 30, 40) == 0
    assert tile_start(100, 0, 3, 40) == 0 and tile_start(100, 97, 100, 40) == 60
    assert tile_start(90, 85, 88, 40) == 50  # the last tile is cut back to end at the document's end
    assert tile_start(100, 10, 45, 40) is None  # longer than half a tile, straddling: no tile holds it
    assert tile_start(30, 5, 9, 40) == 0  # a document shorter than a tile is one tile
    for first in range(0, 96):  # any span of up to half a tile is held whole by one
        lo = tile_start(100, first, first + 4, 40)
        assert lo is not None and lo <= first and first + 4 <= lo + 40


def test_tiled_teachers_are_a_few_windows_each_holding_its_rows_sentence(inference):
    tok = inference.tokenizer
    doc = " ".join([DOC] * 4)
    prompts = fact_prompts(doc, FactConfig())
    offsets = token_offsets(tok, doc)
    tiled = teacher_systems(tok, doc, prompts, FactConfig(teacher_tokens=96, teacher_tiles=True), offsets)
    centred = teacher_systems(tok, doc, prompts, FactConfig(teacher_tokens=96), offsets)
    assert len(set(tiled)) < len(set(centred)) / 2  # one prefill a tile, not one a sentence
    for fp, window in zip(prompts, tiled):
        assert doc[fp.span[0]:fp.span[1]] in window and window in doc
        assert len(tok(window, add_special_tokens=False).input_ids) <= 98
    with pytest.raises(CartridgeError, match="teacher_tiles"):
        FactConfig(teacher_tiles=True).check()


@pytest.mark.parametrize("window", [None, 16])
def test_fact_rows_carry_the_teachers_scores_of_the_documents_answers(inference, window):
    from final.training.teacher import ChunkContext, teacher_system

    cfg = FactConfig(kinds=("cloze",), teacher_tokens=window, top_k=4)
    rows = fact_rows(inference, DOC, cfg)
    tok = inference.tokenizer
    assert len(rows) == len(fact_prompts(DOC, cfg))
    row = rows[0]
    assert tok.decode(row.answer_ids[:-1]) == row.answer and row.target_start == 1
    assert len(row.top_ids) == len(row.prompt_ids) + len(row.answer_ids) - 1
    system = teacher_system(DOC) if window is None else teacher_window(tok, DOC, fact_prompts(DOC, cfg)[0].span, 16)
    with ChunkContext(inference, system, "__check") as ctx:
        (tops, _), = ctx.teacher_scores([row.prompt_ids], [row.answer_ids], 4)
    assert [[t for t, _ in top] for top in tops] == row.top_ids
    assert all(abs(a - b) < 1e-4 for top, lps in zip(tops, row.top_logprobs) for (_, a), b in zip(top, lps))


def test_teacher_answers_are_the_teachers_own_greedy_answers_in_its_window(inference):
    """--answers teacher: a row's answer is what the teacher says, asked the row's question with its window as the
    system turn (regenerated here the same way), closed by the end-of-turn token where it stopped, scored by it."""
    from final.training.document.facts import end_of_turn
    from final.training.teacher import ChunkContext

    cfg = FactConfig(kinds=("ask",), teacher_tokens=16, top_k=4, answers="teacher", answer_tokens=6)
    rows = fact_rows(inference, DOC, cfg)
    tok, end = inference.tokenizer, end_of_turn(inference.tokenizer)
    prompts = fact_prompts(DOC, cfg)
    assert len(rows) == len(prompts) and any(r.answer != p.answer for r, p in zip(rows, prompts))
    for row, fp in zip(rows[:3], prompts):
        with ChunkContext(inference, teacher_window(tok, DOC, fp.span, 16), "__check") as ctx:
            got = ctx.generate([[{"role": "user", "content": fp.question}]], temperature=0.0, max_tokens=6).rows()[0]
            (tops, _), = ctx.teacher_scores([row.prompt_ids], [row.answer_ids], 4)
        said = [t for t in got.output_ids if t != end]
        assert row.answer_ids == (said + [end] if got.finish_reason == "stop" else said or [end])
        assert row.answer == tok.decode(said, skip_special_tokens=True) and len(row.answer_ids) <= 7
        assert [[t for t, _ in top] for top in tops] == row.top_ids


def test_given_answers_are_scored_by_the_teacher_in_place_of_the_documents(inference):
    """fact_rows(given=...): answers made elsewhere (bench/cartridge_own_answers.py: a cartridge's own), one per
    prompt in order, are the rows' answers, scored by the same teacher; a count that does not match is refused."""
    from final.training.document.facts import end_of_turn

    cfg = FactConfig(kinds=("cloze",), top_k=4)
    tok, end = inference.tokenizer, end_of_turn(inference.tokenizer)
    given = [tok(f"Answer {i}", add_special_tokens=False).input_ids + [end] for i in range(len(fact_prompts(DOC, cfg)))]
    rows = fact_rows(inference, DOC, cfg, given=given)
    assert [r.answer_ids for r in rows] == given and rows[1].answer == "Answer 1"
    assert all(len(r.top_ids) == len(r.prompt_ids) + len(r.answer_ids) - 1 for r in rows)
    with pytest.raises(CartridgeError, match="given"):
        fact_rows(inference, DOC, cfg, given=given[1:])


def test_bad_fact_settings_are_named():
    with pytest.raises(CartridgeError, match="fact_kinds"):
        FactConfig(kinds=("quiz",)).check()
    with pytest.raises(CartridgeError, match="teacher_tokens"):
        FactConfig(teacher_tokens=3).check()
    with pytest.raises(CartridgeError, match="quote_sentences"):
        FactConfig(quote_sentences=0).check()
    with pytest.raises(CartridgeError, match="answers"):
        FactConfig(answers="model").check()
    with pytest.raises(CartridgeError, match="answer_tokens"):
        FactConfig(answer_tokens=0).check()


def test_cli_learn_writes_rows_and_a_trained_cartridge_and_resumes(tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(DOC)
    out = tmp_path / "c.pt"
    args = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "8", "--out", str(out),
            "--steps", "2", "--batch", "2", "--model", TINY, "--quiet"]
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
    assert main(args + ["--fact-kinds", "quiz"]) != 0
    # rows made with other settings (or from another document) are refused, not trained on
    assert main(args + ["--fact-kinds", "cloze"]) != 0
    assert "facts differ" in capsys.readouterr().err
    assert main(args + ["--cloze-context", "1"]) != 0  # the flag reaches the rows' settings
    assert "facts differ" in capsys.readouterr().err
    assert main(args + ["--answers", "teacher"]) != 0  # so does --answers
    assert "facts differ" in capsys.readouterr().err
    assert main(args + ["--answer-tokens", "8"]) != 0  # a length for answers the document gives: refused, named
    assert "answer_tokens" in capsys.readouterr().err
    assert main(args + ["--hard", "-1"]) != 0
    assert "hard" in capsys.readouterr().err
    assert main(args + ["--teacher-tiles"]) != 0  # tiles of what: refused, named
    assert "teacher_tiles" in capsys.readouterr().err
    (tmp_path / "doc.txt").write_text(DOC + " A new sentence.")
    assert main(args) != 0
    assert "text_sha256 differ" in capsys.readouterr().err
    assert main(["cartridge", "learn", "--text", str(tmp_path / "none.txt"), "--tokens", "8", "--out",
                 str(tmp_path / "d.pt"), "--model", TINY]) != 0


def test_learn_notes_a_long_document_taught_whole_and_not_in_windows(tmp_path, capsys, monkeypatch):
    """Past LONG_DOCUMENT tokens the whole-document teacher costs several times the windows' (bench/RESULTS.md):
    `learn` says so before it starts, and not when --teacher-tokens is given or the document is short."""
    from final.training import learn

    (tmp_path / "doc.txt").write_text(DOC)
    args = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "8", "--out",
            str(tmp_path / "c.pt"), "--steps", "1", "--batch", "2", "--model", TINY, "--quiet", "--beside", "0"]
    assert main(args) == 0
    assert "note:" not in capsys.readouterr().err  # the real threshold: DOC is far below it
    monkeypatch.setattr(learn, "LONG_DOCUMENT", 16)
    (tmp_path / "c.pt").unlink()
    (tmp_path / "c.pt.ckpt").unlink(missing_ok=True)
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "note:" in err and "--teacher-tokens 256" in err and "doc.txt" in err
    assert main(["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "8", "--out",
                 str(tmp_path / "w.pt"), "--steps", "1", "--batch", "2", "--model", TINY, "--quiet", "--beside",
                 "0", "--teacher-tokens", "16"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_learn_refuses_a_document_it_cannot_read_or_shorter_than_the_cartridge_naming_the_flag(tmp_path, capsys):
    """A document that, with a fact row after it, is past the model's context window (the tiny model's 4,096; the
    shipped 6.7k-token skarrow) is refused before any row is written - the file and field named, and the flag
    that reads it in windows - instead of failing inside the rows with an internal cartridge's name."""
    from pathlib import Path

    doc = Path(__file__).resolve().parent.parent / "bench" / "qa" / "skarrow.txt"
    base = ["cartridge", "learn", "--text", str(doc), "--tokens", "8", "--steps", "1", "--model", TINY, "--quiet"]
    for extra, fix in (([], "--teacher-tokens 256"), (["--teacher-tokens", "256", "--start-tokens", "0"],
                                                       "--start-tokens 256")):
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
