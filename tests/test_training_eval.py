"""The QA sets (data/qa) and the QA evaluation (`final cartridge eval --qa`): the shipped sets are well formed and
cover their documents, bad files are refused by file, line and field, and the evaluation's conditions agree where
they are the same KV (tiny model, real engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cartridges_helpers import TINY
from serve_helpers import DOC_A
from final.training.evaluate.questions import load_qa
from final.training.evaluate.accuracy import WHOLE, choose, normalise, qa_evaluate, wilson
from final.errors import CartridgeError

from training_helpers import data, inference  # noqa: F401  (the module's engine and rows fixtures)

QA = Path(__file__).resolve().parent.parent / "data" / "qa"
SETS = ("brennock", "kestrel", "lake_ivra")  # ~1,000 tokens each
LONG = ("skarrow",)  # ~6,700 tokens: near SmolLM2's 8,192-token window
# ~1,000 tokens each, all test: fresh held-out data (data/qa/README.md)
HELD_OUT = ("corvane", "orrin_vale", "halden_ferry", "quellet", "tollmere", "vessary", "marrowby", "pellam",
            "caddow", "fennick", "brindle", "ottery", "hollinbeck", "pennaveth")


@pytest.mark.parametrize("name", SETS + LONG)
def test_each_shipped_set_has_40_questions_over_the_whole_document_in_two_halves(name):
    qa = load_qa(QA / f"{name}.jsonl")
    assert len(qa.questions) >= 40 and all(len(q.choices) == 4 for q in qa.questions)
    for split in ("tune", "test"):
        half = load_qa(QA / f"{name}.jsonl", split).questions
        assert len(half) >= 20 and {q.split for q in half} == {split}
        positions = [q.position for q in half]
        assert min(positions) < 0.1 and max(positions) > 0.85  # each half spans the document
    assert len({q.answer for q in qa.questions}) == 4  # the right option is not always in one place
    assert 24_000 < len(qa.document) < 30_000 if name in LONG else 3_000 < len(qa.document) < 6_000


@pytest.mark.parametrize("name", HELD_OUT)
def test_each_held_out_set_is_all_test_over_the_whole_document(name):
    qa = load_qa(QA / f"{name}.jsonl")
    assert len(qa.questions) >= 40 and all(len(q.choices) == 4 for q in qa.questions)
    assert {q.split for q in qa.questions} == {"test"} and not load_qa(QA / f"{name}.jsonl", "tune").questions
    positions = [q.position for q in qa.questions]
    assert min(positions) < 0.1 and max(positions) > 0.85
    assert len({q.answer for q in qa.questions}) == 4
    assert 3_000 < len(qa.document) < 6_000


def line(**kw) -> str:
    row = {"id": "a", "split": "tune", "question": "Who keeps the light?", "choices": ["Mara", "Pip", "Jot", "Fen"],
           "answer": 0, "reference": "Mara", "support": "Mara Quill"}
    return json.dumps({k: v for k, v in {**row, **kw}.items() if v is not None})


@pytest.mark.parametrize("text, field", [
    (line(split="dev"), "split"), (line(answer=4), "answer"), (line(answer=True), "answer"),
    (line(choices=["Mara", "Mara"]), "choices"), (line(support="Mara Quilt"), "support"),
    (line(question=""), "question"), (line(reference=None), "reference"), ("[1, 2]", "line 2"),
    ("{not json", "line 2"), (line(id="first"), "id"),
])
def test_a_bad_question_line_names_its_file_line_and_field(tmp_path, text, field):
    (tmp_path / "s.txt").write_text(DOC_A)
    path = tmp_path / "s.jsonl"
    path.write_text(line(id="first") + "\n" + text + "\n")
    with pytest.raises(CartridgeError) as err:
        load_qa(path)
    assert err.value.field == field and str(path) in str(err.value) and "line 2" in str(err.value)


def test_a_missing_document_or_split_is_named(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text(line() + "\n")
    with pytest.raises(CartridgeError) as err:
        load_qa(path)
    assert err.value.field == "document"
    with pytest.raises(CartridgeError) as err:
        load_qa(path, "dev", document=QA / "brennock.txt")
    assert err.value.field == "split"


def test_wilson_interval_and_answer_normalisation():
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert normalise("It has 6,300 people.") == "it has 6300 people" and "6300" in normalise("6,300")


def test_the_conditions_that_are_the_same_kv_score_the_same(inference, tmp_path):
    """A cartridge that is the whole document's KV scores as the whole document (KL 0, same answers); the whole
    document's KL to itself is 0, and every row asks every question."""
    from final.cartridges.build import build_from_text
    from final.training.teacher import teacher_ids

    (tmp_path / "s.txt").write_text(DOC_A)
    rows = [line(id="a"), line(id="b", question="How many cats does she keep?", choices=["three", "two", "one"],
                               reference="three", support="three cats")]
    (tmp_path / "s.jsonl").write_text("\n".join(rows) + "\n")
    qa = load_qa(tmp_path / "s.jsonl")
    cart = build_from_text(inference.engine, teacher_ids(inference.tokenizer, DOC_A))
    got = {r.condition: r for r in qa_evaluate(inference, qa.document, qa.questions, cart, multiple=2,
                                               open_tokens=4)}
    assert list(got) == ["no document", WHOLE, "cartridge"]  # first p / k*p: not shorter than the document
    assert got[WHOLE].kl == 0 and got["cartridge"].kl == pytest.approx(0, abs=1e-5)
    for key in ("acc", "acc_norm", "contains"):
        assert getattr(got["cartridge"], key) == getattr(got[WHOLE], key)
    assert got["no document"].kl > 0.01 and all(r.questions == 2 for r in got.values())
    assert got["cartridge"].right == got[WHOLE].right  # the same questions right, named by id
    assert all(set(r.right) <= {"a", "b"} and len(r.right) == round(r.acc * 2) for r in got.values())


def test_cli_eval_with_a_question_set(inference, tmp_path, capsys):
    from final.cartridges.build import build_from_text
    from final.cartridges.format import save_cartridge
    from final.cartridge_commands import main
    from final.training.teacher import teacher_ids

    (tmp_path / "s.txt").write_text(DOC_A)
    (tmp_path / "s.jsonl").write_text(line(id="a") + "\n" + line(id="b", split="test") + "\n")
    ids = teacher_ids(inference.tokenizer, DOC_A)
    path = save_cartridge(build_from_text(inference.engine, ids[:4]), tmp_path / "c.pt")
    assert main(["cartridge", "eval", str(path), "--model", TINY, "--qa", str(tmp_path / "s.jsonl"),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["qa"]
    assert report["questions"] == 1 and report["split"] == "tune"  # the test half is not asked by default
    assert [r["condition"] for r in report["rows"]] == ["no document", "first 4 tokens", WHOLE, "cartridge"]
    # (the first 8p = 32 tokens: not shorter than the document, so no row)
    first, cart = report["rows"][1], report["rows"][3]
    assert cart["kl"] == pytest.approx(first["kl"], abs=1e-6)  # the cartridge is the first 4 tokens' KV
    assert cart["right"] == first["right"] and len(cart["right"]) == round(cart["acc"])  # ids, for a breakdown
    with pytest.raises(SystemExit):  # the question set is what eval asks
        main(["cartridge", "eval", str(path), "--model", TINY])


def test_the_relevant_chunk_row_asks_each_question_after_its_own_window(inference, tmp_path, capsys):
    """`chunk_tokens` / --chunk-tokens add the relevant-chunk row, last: each question after the window of the
    document around its support (which it contains; shifted to fit at the document's start; the whole support even
    where longer); a window as long as the document is the whole document (KL 0, same choices); a bad N or a support
    not in the text is refused by field."""
    from final.cartridge_commands import main
    from final.training.evaluate.questions import Question
    from final.training.evaluate.accuracy import CHUNK, relevant_chunks

    (tmp_path / "s.txt").write_text(DOC_A)
    rows = [line(id="a"), line(id="b", question="How many cats does she keep?", choices=["three", "two", "one"],
                               reference="three", support="three cats named Pip"),
            line(id="c", split="test", question="What does she keep?", support="The lighthouse keeper")]
    (tmp_path / "s.jsonl").write_text("\n".join(rows) + "\n")
    qs = load_qa(tmp_path / "s.jsonl").questions
    tok = inference.tokenizer
    chunks = relevant_chunks(tok, DOC_A, qs, 6)
    assert all(q.support in c and c in DOC_A for q, c in zip(qs, chunks)) and len(set(chunks)) == 3
    assert all(5 <= len(tok(c, add_special_tokens=False).input_ids) <= 7 for c in chunks)  # ~6, re-tokenised
    assert DOC_A.startswith(chunks[2])  # at the document's start the window is shifted, not cut
    assert all(q.support in c for q, c in zip(qs, relevant_chunks(tok, DOC_A, qs, 1)))
    assert relevant_chunks(tok, DOC_A, qs, 10_000) == [DOC_A] * 3

    got = {r.condition: r for r in qa_evaluate(inference, DOC_A, qs[:2], p=4, multiple=2, open_tokens=4,
                                               chunk_tokens=10_000)}
    assert list(got) == ["no document", "first 4 tokens", "first 8 tokens", WHOLE, CHUNK]
    assert got[CHUNK].kl == pytest.approx(0, abs=1e-5) and got[CHUNK].questions == 2
    assert (got[CHUNK].acc, got[CHUNK].acc_norm, got[CHUNK].prefix_tokens) == (
        got[WHOLE].acc, got[WHOLE].acc_norm, got[WHOLE].prefix_tokens)
    for bad, field in ((0, "chunk_tokens"), (6, "support")):
        with pytest.raises(CartridgeError) as err:
            qa_evaluate(inference, DOC_A, [Question("x", "tune", "Who?", ("a", "b"), 0, "a", "Orvanis lamp", 0.0)],
                        p=4, chunk_tokens=bad)
        assert err.value.field == field

    path = tmp_path / "c.pt"
    assert main(["cartridge", "build", "--text", str(tmp_path / "s.txt"), "--out", str(path), "--model", TINY]) == 0
    capsys.readouterr()
    assert main(["cartridge", "eval", str(path), "--model", TINY, "--qa", str(tmp_path / "s.jsonl"),
                 "--chunk-tokens", "6", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["qa"]["rows"]
    assert [r["condition"] for r in report] == ["no document", WHOLE, "cartridge", CHUNK]
    chunk = report[3]
    assert chunk["questions"] == 2 and chunk["kl"] > 0 and chunk["prefix_tokens"] < report[1]["prefix_tokens"]
    assert main(["cartridge", "eval", str(path), "--model", TINY, "--qa", str(tmp_path / "s.jsonl"),
                 "--chunk-tokens", "0"]) != 0
    assert "field 'chunk_tokens'" in capsys.readouterr().err


def test_the_bench_breaks_accuracy_down_by_the_kind_of_answer(capsys):
    """bench/cartridge_qa.py's breakdown: a number (digits or a number word), a name, an ordinary word; each
    condition's right ids (QARow.right) counted per kind, pooled over the sets."""
    import importlib.util

    from final.training.evaluate.accuracy import QARow

    path = Path(__file__).parent.parent / "bench" / "cartridge_qa.py"
    spec = importlib.util.spec_from_file_location("cartridge_qa", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert [bench.answer_kind(r) for r in ("1742", "eleven", "Two years", "Odo Brennock", "slate", "the left side")] \
        == ["number", "number", "number", "name", "word", "word"]
    kinds = {"a": "name", "b": "number", "c": "word", "d": "word"}
    rows = {"cartridge": [QARow("cartridge", 64, 2, 0.5, (0, 1), 0.5, (0, 1), 0, (0, 1), 0, 0, (0, 0), 0, ("a",)),
                          QARow("cartridge", 64, 2, 1.0, (0, 1), 1.0, (0, 1), 0, (0, 1), 0, 0, (0, 0), 0, ("c", "d"))]}
    bench.print_by_kind(rows, kinds)
    assert "| cartridge | 1 / 1 | 0 / 1 | 2 / 2 |" in capsys.readouterr().out


def test_acc_norm_divides_by_characters_as_lm_eval_does():
    """lm-eval 0.4.13 (api/task.py, a multiple-choice task's process_results) normalises each option's
    log-likelihood by its length in characters, `len(choice)`: an accented option is not longer for its bytes.
    Here "café" (4 characters, 5 bytes) at -4.4 and "cafe!" (5, 5) at -5.2: per character -1.10 vs -1.04, so
    acc_norm picks the second; per byte it would pick the first (-0.88 vs -1.04). acc takes the larger sum."""
    assert choose([-4.4, -5.2], ["café", "cafe!"]) == (0, 1)
    assert choose([-4.4, -5.2], ["cafe", "cafe!"]) == (0, 1)
    assert choose([-3.0, -3.0], ["ab", "ab"]) == (0, 0)  # a tie: the first, as np.argmax
    assert choose([-6.0, -3.0], ["東京都", "大阪"]) == (1, 1)  # CJK: 3 and 2 characters (9 and 6 bytes)
