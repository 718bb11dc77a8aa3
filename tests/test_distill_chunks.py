"""The chunked `select` / `match` start of `learn` (final/distill/chunks.py): the document's own KV, read chunk by
chunk, cut per head by the attention of each chunk's fact rows (tiny model, real engine)."""

from __future__ import annotations

import json

import pytest
import torch

from cartridges_helpers import TINY
from final.training.start.chunks import chunked_init, shares, template, tiles
from final.cartridge_commands import main
from final.training.document.facts import FactConfig, fact_rows
from final.training.teacher import token_offsets
from final.training.teacher import teacher_ids
from final.training.student import Student
from final.errors import CartridgeError
from final.models import resolve_model_path

from test_cartridges_train import inference  # noqa: F401  (the module's engine fixture)
from test_distill_facts import DOC


@pytest.fixture(scope="module")
def student():
    return Student(resolve_model_path(TINY))


@pytest.fixture(scope="module")
def rows(inference):
    return fact_rows(inference, DOC, FactConfig(kinds=("quote", "cloze"), teacher_tokens=16, top_k=4))


def test_tiles_cover_the_document_and_shares_split_the_budget():
    assert tiles(9, 4) == [(0, 4), (4, 9)]  # a last sliver (1 < 4 / 2) joins the tile before
    assert tiles(11, 4) == [(0, 4), (4, 8), (8, 11)] and tiles(3, 8) == [(0, 3)]
    assert shares(10, [4, 4, 3]) == [4, 3, 3] and sum(shares(255, [256] * 26 + [50])) == 255
    assert shares(7, [1, 1]) in ([4, 3], [3, 4])


def test_one_chunk_keeping_every_position_is_the_documents_own_kv(inference, student, rows):
    tok = inference.tokenizer
    ids = teacher_ids(tok, DOC)
    keys, values = chunked_init(student, resolve_model_path(TINY), tok, DOC, rows, len(ids), 1, None)
    full_k, full_v = student.prefill(ids)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(keys + values, full_k + full_v))


@pytest.mark.parametrize("fit", [False, True])
def test_chunks_keep_their_share_of_their_own_kv_and_one_template(inference, student, rows, fit):
    """Each kept (value, key) pair is one of its chunk's own positions (its key moved to the chunk's distance), the
    sink once, a chunk's template end only in the last chunk; with fit (match) the values are refitted."""
    tok, model_dir, p, size = inference.tokenizer, resolve_model_path(TINY), 12, 16
    offsets = token_offsets(tok, DOC)
    spans = tiles(len(offsets), size)
    assert len(spans) >= 2
    keys, values = chunked_init(student, model_dir, tok, DOC, rows, p, 1, size, fit=fit)
    assert keys[0].shape[2] == values[0].shape[2] == p
    head, tail = template(tok)
    chunk_kv = [student.prefill(teacher_ids(tok, DOC[offsets[lo][0]:offsets[hi - 1][1]])) for lo, hi in spans]
    want = [1] + shares(p - 1, [hi - lo for lo, hi in spans])
    assert torch.allclose(values[0][0, :, 0], chunk_kv[0][1][0][0, :, 0])  # the sink: chunk 0's first, kept
    at = 1
    for c, ((ck, cv), n) in enumerate(zip(chunk_kv, want[1:])):
        L = ck[0].shape[2]
        allowed = set(range(head if c else 1, L - tail if c < len(spans) - 1 else L))
        for layer in (0, len(keys) - 1):
            for h in range(keys[layer].shape[1]):
                for j in range(at, at + n):
                    v = values[layer][0, h, j]
                    if fit:
                        continue
                    match = [i for i in allowed if torch.allclose(cv[layer][0, h, i], v, atol=1e-5)]
                    assert match, f"chunk {c} layer {layer} head {h} slot {j}: not one of the chunk's own values"
                    # the key is the same position's, moved by R_{p - L}: same norm (a rotation)
                    assert torch.allclose(keys[layer][0, h, j].norm(), ck[layer][0, h, match[0]].norm(), atol=1e-4)
        at += n
    if fit:  # the refitted values are not the chunks' own
        own = torch.cat([cv[0][0, :, 1:] for _, cv in chunk_kv], 1)
        assert not any(torch.allclose(values[0][0, 0, 5], own[0, i], atol=1e-5) for i in range(own.shape[1]))


def test_a_budget_smaller_than_the_chunks_or_a_chunk_without_rows_is_named(inference, student, rows):
    tok, model_dir = inference.tokenizer, resolve_model_path(TINY)
    with pytest.raises(CartridgeError) as err:
        chunked_init(student, model_dir, tok, DOC, rows, 2, 1, 16)
    assert err.value.field == "tokens"
    with pytest.raises(CartridgeError) as err:
        chunked_init(student, model_dir, tok, DOC, [r for r in rows if r.chunk[0] >= 32], 12, 1, 16)
    assert err.value.field == "init"


def test_cli_learn_from_a_chunked_start_trains_labels_and_resumes_only_the_same_start(tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(DOC)
    out = tmp_path / "c.pt"
    args = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "12", "--out", str(out),
            "--steps", "2", "--batch", "2", "--model", TINY, "--quiet", "--beside", "0", "--teacher-tokens", "16"]
    assert main(args + ["--init", "select"]) == 0
    manifest = json.loads((tmp_path / "c.pt.manifest.json").read_text())
    assert manifest["labels"]["init"] == "select/16" and manifest["num_tokens"] == 12
    assert main(args + ["--init", "select", "--steps", "3"]) == 0  # resumed: the checkpoint's start, one more step
    assert main(args + ["--init", "match", "--steps", "4"]) != 0  # another start: refused, not mixed in
    assert "init" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse names the choices
        main(args + ["--init", "random"])


def test_cli_learn_starts_from_match_on_the_whole_document_and_from_the_prefix_with_windows(tmp_path):
    """The default start is the one measured best in each regime (bench/RESULTS.md, issue 42)."""
    (tmp_path / "doc.txt").write_text(DOC)
    base = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "12", "--steps", "1", "--batch",
            "2", "--model", TINY, "--quiet", "--beside", "0"]
    for extra, want in (([], "match"), (["--teacher-tokens", "16"], "prefix")):
        out = tmp_path / f"{want}.pt"
        assert main(base + ["--out", str(out)] + extra) == 0
        assert json.loads((tmp_path / f"{want}.pt.manifest.json").read_text())["labels"]["init"] == want


def test_cli_learn_cuts_the_start_from_the_whole_document_while_windows_teach(tmp_path, capsys):
    """--start-tokens 0: the rows are taught from --teacher-tokens windows and the match start is cut from the whole
    document (one chunk), not per window; it is refused where no start is cut (prefix) or too small a chunk."""
    (tmp_path / "doc.txt").write_text(DOC)
    base = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "12", "--steps", "1", "--batch",
            "2", "--model", TINY, "--quiet", "--beside", "0", "--teacher-tokens", "16"]
    assert main(base + ["--out", str(tmp_path / "w.pt"), "--start-tokens", "0"]) == 0
    assert json.loads((tmp_path / "w.pt.manifest.json").read_text())["labels"]["init"] == "match"
    made = json.loads((tmp_path / "w.pt.facts.jsonl.json").read_text())
    assert made["facts"]["teacher_tokens"] == 16  # the rows were taught from windows, not the whole document
    assert main(base + ["--out", str(tmp_path / "s.pt"), "--init", "select", "--start-tokens", "32"]) == 0
    assert json.loads((tmp_path / "s.pt.manifest.json").read_text())["labels"]["init"] == "select/32"
    for extra in (["--init", "prefix", "--start-tokens", "0"], ["--start-tokens", "8", "--init", "match"]):
        assert main(base + ["--out", str(tmp_path / "x.pt")] + extra) != 0
        assert "start" in capsys.readouterr().err and not (tmp_path / "x.pt.facts.jsonl").exists()
