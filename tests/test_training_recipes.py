"""The kept recipes give the same cartridges as before final/distill became final/training and its research variants
left: the same rows, the same loss and KL per step to 4 decimals, the same cartridge, on short seeded runs on the
tiny model. The figures in tests/training_recipes.json were recorded from main's code before the change (c7fd7bc,
`final cartridge ...` with the flags of then); here the same runs go through today's flags and `--settings`.
The shipped documents' fact prompts (quote and cloze rows, every sentence) are compared the same way: reading
Markdown through a parser changed none of their prose, list or table rows."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from cartridges_helpers import TINY
from final.cartridge_commands import main
from final.cartridges.format import load_cartridge
from final.training.document.facts import fact_prompts
from final.training.rows import read_conversations
from final.training.settings import FactConfig

ROOT = Path(__file__).resolve().parents[1]
RECORDED = json.loads((Path(__file__).with_name("training_recipes.json")).read_text())
# recipe -> today's command line after `cartridge`, and its settings file (the flags of then: the record's)
RECIPES = {
    "learn": (["learn", "--steps", "3"], {"batch": 2}),
    "learn_windows": (["learn", "--steps", "3", "--teacher-tokens", "24"], {"batch": 2}),
    "learn_select": (["learn", "--steps", "3", "--init", "select"], {"batch": 2, "beside": 0}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every recipe run once, as the record's were: torch on one thread, in this process."""
    work = tmp_path_factory.mktemp("recipes")
    doc = work / "doc.txt"
    doc.write_text(RECORDED["doc"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, (args, settings) in RECIPES.items():
            assert main(["cartridge", *args, "--text", str(doc), "--tokens", "8", "--out", str(work / f"{name}.pt"),
                         "--model", TINY, "--quiet", "--settings", str(_settings(work, name, settings))]) == 0
        assert main(["cartridge", "train", "--data", str(work / "learn.pt.facts.jsonl"), "--text", str(doc),
                     "--tokens", "8", "--out", str(work / "train.pt"), "--steps", "3", "--model", TINY, "--quiet",
                     "--settings", str(_settings(work, "train", {"batch": 2}))]) == 0
        distill = {"questions": 2, "answer_tokens": 4, "top_k": 4, "init_questions": 2, "validate": 2,
                   "synth": {"min_chunk_tokens": 16, "max_chunk_tokens": 24, "question_tokens": 4}}
        assert main(["cartridge", "distill", "--model", TINY, "--text", str(doc), "--tokens", "8", "--out",
                     str(work / "distill.pt"), "--steps", "2", "--quiet",
                     "--settings", str(_settings(work, "distill", distill))]) == 0
    finally:
        torch.set_num_threads(threads)
    return work


def _settings(work: Path, name: str, values: dict) -> Path:
    path = work / f"{name}.yaml"
    path.write_text(json.dumps(values))  # YAML is a superset of JSON
    return path


def _steps(out: Path) -> dict:
    history = torch.load(f"{out}.ckpt", weights_only=True)["history"]
    cart = load_cartridge(out)
    return {"loss": [r["loss"] for r in history], "kl": [r["forward_kl"] for r in history],
            "cartridge": float(sum(t.double().abs().sum() for t in cart.keys + cart.values))}


@pytest.mark.parametrize("name", [*RECIPES, "train", "distill"])
def test_the_recipe_trains_the_same_cartridge_as_before(runs, name):
    want, got = RECORDED["recipes"][name], _steps(runs / f"{name}.pt")
    assert got["loss"] == pytest.approx(want["loss"], abs=1.5e-4)
    assert got["kl"] == pytest.approx(want["kl"], abs=1.5e-4)
    assert got["cartridge"] == pytest.approx(want["cartridge"], rel=1e-6)  # the sum of |K| and |V|


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_recipe_writes_the_same_rows_as_before(runs, name):
    want = RECORDED["recipes"][name]["rows"]
    rows = read_conversations(runs / f"{name}.pt.facts.jsonl", 49152)
    streams = [[r.prompt_ids, r.answer_ids, list(r.chunk), r.target_start, r.question, r.answer] for r in rows]
    assert len(rows) == want["count"]
    assert hashlib.sha256(json.dumps(streams).encode()).hexdigest() == want["ids"]
    assert sum(sum(x[0] for x in r.top_logprobs) for r in rows) == pytest.approx(want["logprob_sum"], abs=1e-3)


def test_the_shipped_documents_give_the_same_fact_prompts_as_before():
    """Every shipped document (data/qa, experiments/data): the same quote and cloze prompts, in the same order."""
    texts = sorted((ROOT / "data" / "qa").glob("*.txt")) + [ROOT / "experiments" / "data" / "vellmark.txt"]
    got = {}
    for txt in texts:
        fps = fact_prompts(txt.read_text(), FactConfig())
        got[txt.stem] = {"count": len(fps), "sha256": hashlib.sha256(json.dumps(
            [[p.kind, p.question, p.answer, list(p.span)] for p in fps]).encode()).hexdigest()}
    assert got == RECORDED["documents"]
