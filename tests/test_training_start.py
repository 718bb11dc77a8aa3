"""The KV a training starts from (final/training/start/initial.py): the first P tokens, or the document's own KV cut
per head by the attention of its fact rows (select; match refits the values), on the tiny model, real engine."""

from __future__ import annotations

import json

import pytest
import torch

from cartridges_helpers import TINY
from final.cartridge_commands import main
from final.errors import CartridgeError
from final.models import resolve_model_path
from final.training.document.facts import fact_rows
from final.training.settings import FactConfig, TrainConfig
from final.training.start.initial import initial_kv, observed, select_start
from final.training.start.select import select_init
from final.training.teacher import teacher_ids

from training_helpers import DOC, inference, settings, student, tok  # noqa: F401  (the module's fixtures)


@pytest.fixture(scope="module")
def rows(inference):  # noqa: F811
    return fact_rows(inference, DOC, FactConfig(top_k=4))


def test_the_rows_that_pick_the_positions_are_spread_over_the_document(rows):
    picked = observed(rows, 4)
    assert len(picked) == 4 and picked[0] == rows[0].ids and picked[-1] == rows[3 * len(rows) // 4].ids
    assert len(observed(rows[:3], 16)) == 3


def test_a_start_keeping_every_position_is_the_documents_own_kv(tok, student, rows):  # noqa: F811
    ids = teacher_ids(tok, DOC)
    keys, values = select_start(student, resolve_model_path(TINY), ids, observed(rows), len(ids), 1, "select")
    full_k, full_v = student.prefill(ids)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(keys + values, full_k + full_v))


@pytest.mark.parametrize("init", ["select", "match"])
def test_the_start_is_select_init_of_the_whole_document_by_the_rows(tok, student, rows, init):  # noqa: F811
    """learn's start is the same as the on-policy loop's: select_init of the teacher's ids, the rows' streams the
    observation window; its label and fingerprint say which, and a resumed run skips the cut."""
    path = resolve_model_path(TINY)
    cfg = TrainConfig(tokens=12)
    (keys, values), label, fingerprint = initial_kv(student, path, tok, rows, cfg, DOC, init, resumed=False)
    want_k, want_v = select_init(student, path, teacher_ids(tok, DOC), observed(rows), 12, 1, fit=init == "match")
    assert all(torch.equal(a, b) for a, b in zip(keys + values, want_k + want_v))
    assert label == init and fingerprint.startswith(f"{init}:")
    (keys, _), _, again = initial_kv(student, path, tok, rows, cfg, DOC, init, resumed=True)
    assert again == fingerprint and keys[0].shape == want_k[0].shape  # the prefix's shape, the checkpoint's values


def test_starts_that_cannot_be_cut_are_named(tok, student, rows):  # noqa: F811
    path, cfg = resolve_model_path(TINY), TrainConfig(tokens=12)
    for text, init, field in ((None, "match", "init"), (DOC, "random", "init"), ("Short.", "prefix", "text")):
        with pytest.raises(CartridgeError) as err:
            initial_kv(student, path, tok, rows, cfg, text, init, resumed=False)
        assert err.value.field == field


def test_cli_learn_labels_its_start_and_resumes_only_the_same_start(tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(DOC)
    out = tmp_path / "c.pt"
    args = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "12", "--out", str(out),
            "--steps", "2", "--model", TINY, "--quiet", *settings(tmp_path, "batch: 2\nbeside: 0\n")]
    assert main(args + ["--init", "select"]) == 0
    manifest = json.loads((tmp_path / "c.pt.manifest.json").read_text())
    assert manifest["labels"]["init"] == "select" and manifest["num_tokens"] == 12
    assert main(args + ["--init", "select", "--steps", "3"]) == 0  # resumed: the checkpoint's start, one more step
    assert main(args + ["--init", "match", "--steps", "4"]) != 0  # another start: refused, not mixed in
    assert "init" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse names the choices
        main(args + ["--init", "random"])


def test_cli_learn_starts_from_match_and_from_the_prefix_with_windows(tmp_path):
    """The default start is the one measured best in each regime (bench/RESULTS.md, "A start cut from the
    document's own KV"); --init match with windows cuts the start from the whole document while windows teach."""
    (tmp_path / "doc.txt").write_text(DOC)
    base = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "12", "--steps", "1",
            "--model", TINY, "--quiet", *settings(tmp_path, "batch: 2\nbeside: 0\n")]
    for name, extra, want in (("a", [], "match"), ("b", ["--teacher-tokens", "16"], "prefix"),
                              ("c", ["--teacher-tokens", "16", "--init", "match"], "match")):
        assert main(base + ["--out", str(tmp_path / f"{name}.pt")] + extra) == 0
        assert json.loads((tmp_path / f"{name}.pt.manifest.json").read_text())["labels"]["init"] == want
    made = json.loads((tmp_path / "c.pt.facts.jsonl.json").read_text())
    assert made["facts"]["teacher_tokens"] == 16  # the rows were taught from windows, not the whole document
