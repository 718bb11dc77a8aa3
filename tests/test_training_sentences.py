"""A document's sentences (final/training/document/sentences.py) and the fact rows made from them, on documents shaped as users'
files are: hard-wrapped .txt, Markdown with headings and lists, "Key: value" lines, CJK text, runs without end
marks. Each case failed before the splitter read wraps: a wrapped paragraph was split at every line break."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from cartridges_helpers import TINY
from final.cartridge_commands import main
from final.errors import CartridgeError
from final.training.document.facts import fact_prompts
from final.training.document.sentences import LONGEST_SENTENCE, sentences, unwrap
from final.training.evaluate.questions import load_qa, support_spans
from final.training.inputs import read_text
from final.training.settings import FactConfig

QA = Path(__file__).resolve().parent.parent / "data" / "qa"
PROSE = ("Brennock Ferry is a small river town on the eastern bank of the Sallow River, in the province of Upper "
         "Marrow. It was founded in 1742 by a ferryman named Odo Brennock, who ran a rope ferry across the river at "
         "its narrowest point. The ferry was stopped when the wind reached force 6. Tickets cost 3 crowns.\n\n"
         "The railway reached the town in 1874, when the Marrow Valley Railway opened a station on the western edge "
         "of town. Its first stationmaster was Edwin Tarrant.\n")


def wrapped(text: str, width: int) -> str:
    """The text as an editor hard-wraps it: each prose paragraph filled to `width`; headings, lists and tables (a
    Markdown document's) kept as they are."""
    block = re.compile(r" {0,3}(?:#|[-*+>] |\d{1,3}[.)] |\|)", re.M)
    return "\n\n".join(p if block.match(p) or re.search(r"\n(?: {0,3}(?:#|[-*+>] |\d{1,3}[.)] |\|))", p)
                       else textwrap.fill(p, width) for p in text.split("\n\n") if p.strip()) + "\n"


def words(text: str, spans: list[tuple[int, int]]) -> list[str]:
    return [" ".join(text[a:b].split()) for a, b in spans]


@pytest.mark.parametrize("width", [34, 50, 72, 79, 100])
def test_a_hard_wrapped_document_has_the_sentences_and_rows_of_its_unwrapped_text(width):
    text = wrapped(PROSE, width)
    assert "\n" in text.split("\n\n")[0]  # the paragraph is wrapped ("force\n6." included at some widths)
    assert words(text, sentences(text)) == words(PROSE, sentences(PROSE))
    assert len(unwrap(text)) == len(text)  # a span of the unwrapped text is the document's
    flat, wrap = fact_prompts(PROSE, FactConfig()), fact_prompts(text, FactConfig())
    assert [(p.kind, p.question, p.answer) for p in wrap] == [(p.kind, p.question, p.answer) for p in flat]
    assert not any("\n" in p.question or "\n" in p.answer.split("\n\n")[0] for p in wrap)
    assert {p.answer for p in wrap if p.kind == "cloze"} >= {"Sallow River", "Upper Marrow", "Odo Brennock"}


def test_the_shipped_documents_wrapped_at_72_columns_give_the_same_rows():
    for name in ("brennock", "kestrel", "lake_ivra"):
        text = (QA / f"{name}.txt").read_text()
        cfg = FactConfig()
        assert fact_prompts(wrapped(text, 72), cfg) == fact_prompts(text, cfg), name


def test_line_breaks_that_end_something_are_kept():
    doc = ("# Harbour notes\n"
           "Founded: 1742\nPiers: 12\nHarbour master: Ana Vell\n\n"
           "The harbour has three basins and a long stone breakwater on its western side:\n"
           "- the Inner Basin, for fishing boats\n- the Outer Basin\n"
           "1. Moor at the quay.\n2. Pay the harbour dues.\n"
           "| berth | depth |\n| A | 4 m |\n")
    got = words(doc, sentences(doc))
    assert got[:4] == ["# Harbour notes", "Founded: 1742", "Piers: 12", "Harbour master: Ana Vell"]
    assert "- the Inner Basin, for fishing boats" in got and "- the Outer Basin" in got
    assert "1. Moor at the quay." in got and "2. Pay the harbour dues." in got
    assert "| berth | depth |" in got
    assert unwrap(doc) == doc  # nothing here is a wrap


MARKDOWN = ("# Carrow Bay Ferry\n\n"
            "The ferry links Dunmore Quay to the island of Skell.\n\n"
            "- Operator: Skell Island Council\n- Crossing time: 35 minutes\n\n"
            "## Timetable\n\n"
            "| Day | First sailing | Last sailing |\n"
            "|-----|:-------------:|-------------:|\n"
            "| Weekdays | 07:10 | 19:45 |\n"
            "| Sun. and holidays | 09:30 | 17:00 |\n\n"
            "Fares\n=====\n\nA return costs 4 crowns.\n\n---\n\nService began in 1911.\n")


def test_a_markdown_tables_rows_are_sentences_asked_about_under_their_header():
    # A row's cells are named by the header: "| Weekdays | ___ | 19:45 |" alone does not say which sailing is
    # blanked. Before, the header and the rule row were sentences of their own ("What does the document say about
    # |-----|...?"), a row was blanked and quoted without its header, quoted with the next row, and "Sun." split it.
    got = words(MARKDOWN, sentences(MARKDOWN))
    assert "| Weekdays | 07:10 | 19:45 |" in got and "| Sun. and holidays | 09:30 | 17:00 |" in got
    assert "| Day | First sailing | Last sailing |" not in got  # read with every row instead
    assert not [w for w in got if set(w) <= set("|-:= ")]  # no table rule, setext underline or thematic break
    assert "Fares" in got and "A return costs 4 crowns." in got
    rows = fact_prompts(MARKDOWN, FactConfig())
    header = "| Day | First sailing | Last sailing |\n"
    cloze = {p.answer: p.question for p in rows if p.kind == "cloze"}
    assert cloze["07:10"].endswith(f'"{header}| Weekdays | ___ | 19:45 |"')
    assert cloze["17:00"].endswith(f'"{header}| Sun. and holidays | 09:30 | ___ |"')
    quoted = [p.answer for p in rows if p.kind == "quote" and "17:00" in p.answer]
    assert quoted and set(quoted) == {header + "| Sun. and holidays | 09:30 | 17:00 |"}


def test_no_blank_is_left_without_words_around_it_or_takes_an_items_key():
    # "# ___" (a heading blanked) asks nothing; "- ___ time: 35 minutes" blanks the key a user asks by, as a
    # sentence's subject is not blanked
    rows = fact_prompts(MARKDOWN, FactConfig())
    blanked = [p for p in rows if p.kind in ("cloze", "word")]
    assert all(re.search(r"\w", p.question.split('"', 1)[1].replace("___", "")) for p in blanked)
    assert not [p.question for p in blanked if '"# ___"' in p.question]
    answers = {p.answer for p in blanked}
    assert {"Skell Island Council", "35"} <= answers and not {"Operator", "Crossing", "Carrow Bay Ferry"} & answers
    # a sentence without cues is asked about by its words, not its list number
    numbered = [p for p in fact_prompts("1. Moor at the quay.\n2. then pay the dues.\n", FactConfig())
                if p.kind == "quote"]
    assert "then pay the dues" in numbered[1].question
    assert not [p for p in numbered if "2." in p.question]


def test_cjk_sentences_end_at_full_width_marks():
    doc = "东港镇建于一七四二年。镇上有十二座码头！人口约三千四百人？" * 3
    spans = sentences(doc)
    assert len(spans) == 9 and doc[slice(*spans[1])] == "镇上有十二座码头！"


def test_curly_quotes_and_an_ellipsis_close_a_sentence():
    doc = "He wrote “the ferry runs at noon.” Then he left… The ferry’s bell rang."
    assert words(doc, sentences(doc)) == ["He wrote “the ferry runs at noon.”", "Then he left…",
                                          "The ferry’s bell rang."]


def test_a_run_without_end_marks_is_cut_at_clause_marks_and_keeps_every_word():
    doc = ", ".join(f"the ferry stopped at landing {i} near the mill of Odo Vell" for i in range(60))
    spans = sentences(doc)
    assert len(spans) > 5 and all(b - a <= LONGEST_SENTENCE for a, b in spans)
    assert all(doc[b - 1] == "," for _, b in spans[:-1])  # after a clause mark, not inside a word
    assert " ".join(words(doc, spans)) == doc
    assert max(len(p.answer) for p in fact_prompts(doc, FactConfig())) <= 2 * LONGEST_SENTENCE


def test_a_question_sets_support_is_found_across_a_wrap(tmp_path):
    text = wrapped((QA / "brennock.txt").read_text(), 60)
    assert support_spans(text, "on the eastern bank of the Sallow River") != []
    (tmp_path / "brennock.txt").write_text(text)
    (tmp_path / "brennock.jsonl").write_text((QA / "brennock.jsonl").read_text())
    shipped, wrap = load_qa(QA / "brennock.jsonl"), load_qa(tmp_path / "brennock.jsonl")
    assert [q.position for q in wrap.questions] == [q.position for q in shipped.questions]


def test_a_file_that_is_not_utf8_is_named_not_a_traceback(tmp_path, capsys):
    doc = tmp_path / "cafe.txt"
    doc.write_bytes("Café Brennock was founded in 1742.\r\n".encode("latin-1"))
    assert main(["cartridge", "learn", "--text", str(doc), "--tokens", "8", "--out", str(tmp_path / "c.pt"),
                 "--steps", "1", "--model", TINY, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert str(doc) in err and "'text'" in err and "not UTF-8" in err and "0xe9 at offset 3" in err
    assert not (tmp_path / "c.pt").exists()
    (tmp_path / "cafe.jsonl").write_text("Café".encode("utf-16").decode("latin-1"), encoding="latin-1")
    with pytest.raises(CartridgeError, match="not UTF-8") as exc:
        load_qa(tmp_path / "cafe.jsonl", document=QA / "brennock.txt")
    assert exc.value.field == "qa"
    doc.write_bytes(wrapped(PROSE, 60).replace("\n", "\r\n").encode("utf-8"))  # a Windows file, wrapped
    assert read_text(doc) == wrapped(PROSE, 60)
    assert words(read_text(doc), sentences(read_text(doc))) == words(PROSE, sentences(PROSE))


def test_an_abbreviations_period_ends_no_sentence_and_stays_in_its_name():
    doc = ("The station was directed by Dr. Samir Okonkwo-Lind, who came from St. Cuthra's in 1998. Locomotive No. 3 "
           "was built c. 1820 by J. R. Ailes for the U.S. Navy, e.g. for towing. It carried coal, slate, etc. and "
           "some wool. So did I.\n\nPart V. The Scientific Party\n\nThe ferry ran at 9 a.m. The bell rang.")
    assert words(doc, sentences(doc)) == [
        "The station was directed by Dr. Samir Okonkwo-Lind, who came from St. Cuthra's in 1998.",
        "Locomotive No. 3 was built c. 1820 by J. R. Ailes for the U.S. Navy, e.g. for towing.",
        "It carried coal, slate, etc. and some wool.", "So did I.", "Part V. The Scientific Party",
        "The ferry ran at 9 a.m.", "The bell rang."]
    rows = fact_prompts(doc, FactConfig())
    blanks = {p.answer for p in rows if p.kind == "cloze"}
    assert {"Dr. Samir Okonkwo-Lind", "St. Cuthra's", "J. R. Ailes", "U.S. Navy"} <= blanks
    assert not any(p.answer in ("Dr", "St", "Samir Okonkwo-Lind", "Cuthra's") for p in rows)
    shipped = (QA / "brennock.txt").read_text()
    assert "St. Cuthra's Church, the oldest building" in {shipped[a:b][:40] for a, b in sentences(shipped)}


def test_a_byte_order_mark_is_not_part_of_the_document_or_the_question_set(tmp_path):
    doc = tmp_path / "notepad.txt"
    doc.write_bytes(b"\xef\xbb\xbf" + PROSE.encode("utf-8"))  # Notepad's "UTF-8 with BOM"
    assert read_text(doc) == PROSE
    (tmp_path / "brennock.txt").write_text((QA / "brennock.txt").read_text())
    (tmp_path / "brennock.jsonl").write_bytes(b"\xef\xbb\xbf" + (QA / "brennock.jsonl").read_bytes())
    assert load_qa(tmp_path / "brennock.jsonl").questions == load_qa(QA / "brennock.jsonl").questions


def test_a_word_wrapped_at_its_hyphen_is_one_word_again():
    # textwrap (and most editors) break "red-brick" after the hyphen: read as a break, the row says "red- brick"
    # and the name "Okonkwo-\nLind" becomes "Okonkwo- Lind". Every shipped document, at every width that breaks
    # one of its hyphens, gives its unwrapped rows again.
    cfg, broken = FactConfig(), 0
    for path in sorted(QA.glob("*.txt")):
        text = path.read_text()
        flat = [(p.kind, p.question, p.answer) for p in fact_prompts(text, cfg)]
        for width in range(60, 81):
            wrap = wrapped(text, width)
            if "-\n" in wrap:
                broken += 1
                assert [(p.kind, p.question, p.answer) for p in fact_prompts(wrap, cfg)] == flat, (path.name, width)
    assert broken > 50
    # typeset text breaks a word at a syllable: joined without its hyphen where the document spells it so elsewhere
    typeset = textwrap.fill("In the census of 1901 the town counted its popu-lation for the first time by house; "
                            "the population was 3,000 and the houses were 412.", 50)
    assert "popu-\n" in typeset and "counted its population for" in " ".join(unwrap(typeset).split())
    assert "red-brick mill" in " ".join(unwrap("A row of houses stood beside the old red-\nbrick mill.").split())


def test_every_shipped_question_is_found_in_its_document_wrapped_at_a_hyphen(tmp_path):
    for path in sorted(QA.glob("*.txt")):
        text = path.read_text()
        width = next((w for w in range(60, 81) if "-\n" in wrapped(text, w)), None)
        if width is None:
            continue
        (tmp_path / path.name).write_text(wrapped(text, width))
        (tmp_path / f"{path.stem}.jsonl").write_text(path.with_suffix(".jsonl").read_text())
        assert len(load_qa(tmp_path / f"{path.stem}.jsonl").questions) == len(load_qa(
            path.with_suffix(".jsonl")).questions), path.name


CODE = ("The harbour charges dues by length.\n\n"
        "```python\n"
        "def dues(length):\n"
        "    return 2 * length  # Dues are paid at the quay.\n"
        "```\n\n"
        "Boats under 8 m pay nothing. The rule dates from 1911.\n\n"
        "    total = dues(12)\n"
        "    print(total)\n\n"
        "- The Inner Basin holds 40 boats.\n\n"
        "~~~\nNot prose: Ada Pell 1911.\n~~~\n")


def test_code_blocks_are_not_sentences_and_their_lines_are_never_joined():
    """Markdown read by a parser (markdown-it-py): a fenced block's fence lines and code lines, and an indented block
    after a blank line, are code - no sentence, no row - and a wrap is never joined into or out of them; the prose,
    the list item and the heading around them are read as before."""
    got = words(CODE, sentences(CODE))
    assert got == ["The harbour charges dues by length.", "Boats under 8 m pay nothing.", "The rule dates from 1911.",
                   "- The Inner Basin holds 40 boats."]
    assert unwrap(CODE) == CODE
    asked = " ".join(p.question + " " + p.answer for p in fact_prompts(CODE, FactConfig()))
    assert "def dues" not in asked and "print" not in asked and "Ada Pell" not in asked and "```" not in asked
    wrapped_code = "A line of prose that is long enough to look like a wrapped paragraph of text\n```\nx = 1\n```\n"
    assert "x = 1" not in " ".join(words(wrapped_code, sentences(wrapped_code)))


def test_a_table_is_what_the_parser_says_it_is():
    """GitHub's table: a header row and a delimiter row; rows until a blank line. Its rows are sentences asked under
    the header; a "|" line with no delimiter row under it is an ordinary line."""
    table = "| Day | Last |\n|-----|------|\n| Sun | 17:00 |\n| Mon | 18:00 |\n\n| not | a table |\n"
    got = words(table, sentences(table))
    assert got == ["| Sun | 17:00 |", "| Mon | 18:00 |", "| not | a table |"]
    quotes = [p.answer for p in fact_prompts(table, FactConfig()) if p.kind == "quote"]
    assert "| Day | Last |\n| Sun | 17:00 |" in quotes
