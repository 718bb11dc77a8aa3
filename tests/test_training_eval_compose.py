"""Two cartridges served together, judged by questions (final.training.evaluate.composed, `final cartridge eval --compose`):
every condition's row exists, the composed row is what the store serves a request naming both cartridges
(InferenceEngine.score with cartridge=[a, b]), and bad flags or files are refused by name (tiny model, real engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cartridges_helpers import TINY
from serve_helpers import DOC_A, DOC_B
from final.cartridges.build import build_from_text
from final.cartridges.format import CartridgeKV, save_cartridge
from final.training.evaluate.questions import load_qa
from final.training.evaluate.composed import SEPARATOR, ComposeResult, ComposeSet, both_documents, compose_evaluate
from final.training.evaluate.accuracy import QARow, ask
from final.training.teacher import teacher_ids
from final.errors import CartridgeError

from training_helpers import inference  # noqa: F401  (the module's engine fixture)

P = 8  # tokens of each first-p prefix cartridge
QUESTIONS = {
    "orvanis": (DOC_A, [("Who keeps the lighthouse?", ["Mara Quill", "Pip", "Jot Fennel", "Tallow"], 0, "Quill"),
                        ("How many cats does she keep?", ["two", "three", "four", "none"], 1, "three cats")]),
    "tallow": (DOC_B, [("When does Tallow Creek flood?", ["in June", "in May", "in April", "never"], 2,
                        "every April"),
                       ("Where does the ferry go?", ["Orvanis", "Dunmore", "the sea", "Quill"], 1, "Dunmore")]),
}


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, Path]:
    """Two tiny question sets (NAME.jsonl, NAME.txt beside it), two questions each, both in the tune half."""
    folder = tmp_path_factory.mktemp("qa")
    out = {}
    for name, (doc, qs) in QUESTIONS.items():
        (folder / f"{name}.txt").write_text(doc)
        rows = [{"id": f"{name}-{i}", "split": "tune", "question": q, "choices": c, "answer": a, "reference": c[a],
                 "support": s} for i, (q, c, a, s) in enumerate(qs)]
        (folder / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        out[name] = folder / f"{name}.jsonl"
    return out


@pytest.fixture(scope="module")
def files(inference, sets, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    """Each document's first-P-token prefix cartridge, saved as a user's file."""
    folder = tmp_path_factory.mktemp("carts")
    return {name: save_cartridge(build_from_text(inference.engine, teacher_ids(inference.tokenizer, doc)[:P]),
                                 folder / f"{name}.pt") for name, (doc, _) in QUESTIONS.items()}


def compose_sets(inference, sets, files):  # noqa: F811
    from final.cartridges.service import CartridgeService

    service = CartridgeService(inference.engine, inference.model_dir)
    return [ComposeSet(name, QUESTIONS[name][0], load_qa(sets[name]).questions, service.read_served(files[name]))
            for name in ("orvanis", "tallow")]


def store_scores(inference, questions, cartridge) -> list[list[float]]:  # noqa: F811
    """Per question, each option's log-likelihood as InferenceEngine.score serves it after `cartridge`."""
    return [[s.logprob for s in inference.score([[{"role": "user", "content": q.question}]] * len(q.choices),
                                                list(q.choices), cartridge=cartridge)] for q in questions]


def test_every_condition_has_a_row_and_the_composed_row_is_what_the_store_serves(inference, sets, files):  # noqa: F811
    a, b = compose_sets(inference, sets, files)
    result = compose_evaluate(inference, a, b, open_tokens=4)
    assert result.separator == SEPARATOR == "\n\n" and result.composed == "orvanis + tallow"
    both = len(teacher_ids(inference.tokenizer, both_documents(DOC_A, DOC_B)))
    for name in ("orvanis", "tallow"):
        rows = {r.condition: r for r in result.rows[name]}
        assert list(rows) == ["no document", "orvanis in context", "tallow in context", "orvanis + tallow in context",
                              "tallow + orvanis in context", "cartridge orvanis", "cartridge tallow",
                              "cartridges orvanis + tallow"]
        assert all(r.questions == 2 for r in rows.values()) and rows[f"{name} in context"].kl == 0
        assert rows["cartridges orvanis + tallow"].prefix_tokens == 2 * P
        assert rows["orvanis + tallow in context"].prefix_tokens == both
        assert set(result.ratios[name]) == {"orvanis + tallow in context", "tallow + orvanis in context",
                                            "cartridges orvanis + tallow"}
    inference.load_cartridge(id="orvanis", path=str(files["orvanis"]))  # the user's way: files into the store
    inference.load_cartridge(id="tallow", path=str(files["tallow"]))
    try:
        for s in (a, b):
            lps = store_scores(inference, s.questions, ["orvanis", "tallow"])
            want = [max(range(4), key=lp.__getitem__) == q.answer for lp, q in zip(lps, s.questions)]
            norm = [max(range(4), key=lambda i: lp[i] / len(q.choices[i])) == q.answer
                    for lp, q in zip(lps, s.questions)]
            got = {r.condition: r for r in result.rows[s.name]}["cartridges orvanis + tallow"]
            assert (got.acc, got.acc_norm) == (sum(want) / 2, sum(norm) / 2)
            alone = result.rows[s.name][5]
            ratio = result.ratios[s.name]["cartridges orvanis + tallow"]["acc"]
            assert ratio == (got.acc / alone.acc if alone.acc else None)
    finally:
        inference.unload_cartridge("orvanis")
        inference.unload_cartridge("tallow")
    assert not any(cid.startswith("__compose") for cid in inference.cartridge_ids())  # nothing left loaded


def test_ask_after_two_cartridges_scores_as_the_store_in_either_order(inference, sets, files):  # noqa: F811
    """ask() with two loaded ids gives the right option the log-likelihood score(cartridge=[a, b]) gives; the other
    order scores the same (the prefix is only attended to, each key keeps its position); B changes the scores."""
    inference.load_cartridge(id="orvanis", path=str(files["orvanis"]))
    inference.load_cartridge(id="tallow", path=str(files["tallow"]))
    try:
        qs = load_qa(sets["tallow"]).questions
        got = ask(inference, qs, ("orvanis", "tallow"), 4)
        tok = inference.tokenizer
        mine = [float(torch.log_softmax(g[3], -1).gather(1, torch.tensor(tok(q.choices[q.answer],
                add_special_tokens=False).input_ids)[:, None]).sum()) for q, g in zip(qs, got)]
        store = store_scores(inference, qs, ["orvanis", "tallow"])
        assert mine == pytest.approx([s[q.answer] for s, q in zip(store, qs)], abs=1e-3)
        flat = [x for s in store for x in s]
        assert [x for s in store_scores(inference, qs, ["tallow", "orvanis"]) for x in s] == pytest.approx(flat,
                                                                                                       abs=1e-3)
        alone = store_scores(inference, qs, "orvanis")
        assert max(abs(x - y) for s, t in zip(store, alone) for x, y in zip(s, t)) > 1e-3
        gen = inference.generate([[{"role": "user", "content": q.question}] for q in qs],
                                 cartridge=["orvanis", "tallow"], temperature=0.0, max_tokens=4)
        assert [g[2] for g in got] == gen.completions
    finally:
        inference.unload_cartridge("orvanis")
        inference.unload_cartridge("tallow")


def test_cli_eval_compose_writes_both_sets(inference, sets, files, capsys):  # noqa: F811
    from final.cartridge_commands import main

    assert main(["cartridge", "eval", str(files["orvanis"]), "--model", TINY, "--qa", str(sets["orvanis"]),
                 "--compose", str(files["tallow"]), "--compose-qa", str(sets["tallow"]), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "qa" not in report and report["compose"]["composed"] == "orvanis + tallow"
    for name in ("orvanis", "tallow"):
        rows = [r["condition"] for r in report["compose"]["sets"][name]["rows"]]
        assert "cartridges orvanis + tallow" in rows and "tallow + orvanis in context" in rows  # both orders
        assert report["compose"]["sets"][name]["questions"] == 2


@pytest.mark.parametrize("flags, field, named", [
    (["--compose", "MISSING"], "compose-qa", None),
    (["--compose-qa", "QA_B"], "compose", None),
    (["--compose", "MISSING", "--compose-qa", "QA_B"], "compose", "MISSING"),
    (["--compose", "CART_B", "--compose-qa", "MISSING"], "compose-qa", "MISSING"),
    (["--compose", "SHORT", "--compose-qa", "QA_B"], "num_layers", "SHORT"),
])
def test_cli_compose_refuses_a_missing_flag_or_file_by_name(inference, sets, files, tmp_path, capsys,  # noqa: F811
                                                            flags, field, named):
    from final.cartridge_commands import main

    one_layer = files["tallow"].with_name("one_layer.pt")  # a cartridge for a model with one layer, not two
    cart = build_from_text(inference.engine, teacher_ids(inference.tokenizer, DOC_B)[:P])
    save_cartridge(CartridgeKV(cart.keys[:1], cart.values[:1], 1), one_layer)
    paths = {"MISSING": str(tmp_path / "nowhere.pt"), "QA_B": str(sets["tallow"]), "CART_B": str(files["tallow"]),
             "SHORT": str(one_layer)}
    argv = ["cartridge", "eval", str(files["orvanis"]), "--model", TINY, "--qa", str(sets["orvanis"]),
            *[paths.get(f, f) for f in flags]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"field '{field}'" in err and (named is None or paths[named] in err), err


def test_two_sets_of_one_name_are_refused(inference, sets, files):  # noqa: F811
    a, _ = compose_sets(inference, sets, files)
    with pytest.raises(CartridgeError) as err:
        compose_evaluate(inference, a, a)
    assert err.value.field == "compose-qa"


def test_pooled_counts_each_question_once_where_keeps_takes_the_worse_set():
    def r(cond: str, acc: float, n: int) -> QARow:
        return QARow(cond, 0, n, acc, (0, 1), acc, (0, 1), 0.0, (0, 1), 0.0, 0.0, (0, 0), 0)

    # a: 30 of 40 right alone, 12 composed (0.4x); b: 5 of 10 alone, 10 composed (2x)
    res = ComposeResult(SEPARATOR, "a + b", {
        "a": [r("cartridge a", 0.75, 40), r("cartridges a + b", 0.3, 40)],
        "b": [r("cartridge b", 0.5, 10), r("cartridges a + b", 1.0, 10)]},
        {"a": {"cartridges a + b": {"acc": 0.4}}, "b": {"cartridges a + b": {"acc": 2.0}}})
    assert res.keeps() == pytest.approx(0.4)
    assert res.pooled() == pytest.approx(22 / 35)
    none = ComposeResult(SEPARATOR, "a + b", {"a": [r("cartridge a", 0.0, 4), r("cartridges a + b", 0.5, 4)]})
    assert none.pooled() is None
