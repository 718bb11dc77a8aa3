"""Quiet beside a partner (`learn --quiet-partner`, final/distill/quiet.py): the loudness of our KV to the
partner's rows, computed beside the model's own attention, checked against the attention weights transformers
returns, and trained down. Tiny model, real HF student, real files."""

from __future__ import annotations

import json

import pytest
import torch

from cartridges_helpers import TINY
from serve_helpers import DOC_A
from final.cartridge_commands import main
from final.training.keep import keep_rows
from final.training.losses import distill_loss
from final.training.quiet import measured
from final.training.student import TrainableKV
from final.training.train import Partner, TrainConfig, make_batch, train
from final.errors import CartridgeError
from final.models import resolve_model_path
from final.prompts import document_ids

from test_distill_facts import DOC
from test_distill_keep import PARTNER, student, tok  # noqa: F401 - the tiny student and tokenizer fixtures


@pytest.mark.parametrize("by", ["loudness", "mass"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: each head's query normalised before RoPE
def test_loudness_is_the_norm_of_the_spans_share_of_the_attention_output(tok, arch, by):
    """Against eager attention's own weights: ||sum_{j in span} a_j v_j|| (by="mass": sum_{j in span} a_j), mean
    over heads, per layer."""
    from transformers import AutoModelForCausalLM, DynamicCache

    path = resolve_model_path(f"builtin:tiny-random-{arch}")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    prefix = document_ids(tok, DOC_A)[:20]
    with torch.no_grad():
        cached = model(torch.tensor([prefix]), use_cache=True).past_key_values
    kv = [(layer.keys, layer.values) for layer in cached.layers]
    ids = torch.tensor([tok("What is kept here, and by whom?", add_special_tokens=False).input_ids])
    where = torch.ones_like(ids, dtype=torch.bool)
    where[0, :2] = False
    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    positions = torch.arange(20, 20 + ids.shape[1])
    with torch.no_grad(), measured(model, 5, 15, where, by) as loud:
        out = model(ids, past_key_values=cache, position_ids=positions[None], cache_position=positions,
                    output_attentions=True)
    assert len(loud.layers) == len(kv)
    for got, a, (k, v) in zip(loud.layers, out.attentions, kv):
        groups = a.shape[1] // v.shape[1]
        share = torch.einsum("hqk,hkd->hqd", a[0, :, :, 5:15], v[0, :, 5:15].repeat_interleave(groups, 0))
        want = (share.norm(dim=-1) if by == "loudness" else a[0, :, :, 5:15].sum(-1)).mean(0)[where[0]]
        assert torch.allclose(got, want, atol=1e-5)


def test_the_quiet_term_is_added_and_trains_our_values_only(student, tok):
    pkv = student.prefill(document_ids(tok, PARTNER)[:24])
    rows = keep_rows(student, tok, PARTNER, pkv, 24, top_k=8)
    ours = TrainableKV(*student.prefill(document_ids(tok, DOC_A)[:8]), frozen_tokens=1)
    kept = make_batch(rows[:3], tok.pad_token_id, student.device)
    for front in (True, False):
        own = make_batch(rows[3:5], tok.pad_token_id, student.device)  # stand-ins for our own rows
        own.beside = kept.beside = (*pkv, front)
        own.keep = (kept, 0.0)
        plain = distill_loss(student, ours, own)
        own.quiet = 3.0
        ours.zero_grad()
        out = distill_loss(student, ours, own)
        out.loss.backward()
        assert plain.quiet is None and out.quiet > 0
        assert out.loss.item() == pytest.approx(plain.loss.item() + 3.0 * out.quiet, rel=1e-4)
        assert all(p.grad.abs().sum() > 0 for p in ours.trainable_values)
        assert all(t.grad is None for t in pkv[1])


def test_the_mass_term_does_not_pay_for_smaller_values(student, tok):
    """by="mass": the attention our keys get. Its gradient reaches our keys; our values enter it only through the
    queries of the layers after theirs, so the last layer's values (what our positions say to the questions that
    do read them, with nothing after) get exactly the other terms' gradient."""
    pkv = student.prefill(document_ids(tok, PARTNER)[:24])
    rows = keep_rows(student, tok, PARTNER, pkv, 24, top_k=8)
    ours = TrainableKV(*student.prefill(document_ids(tok, DOC_A)[:8]), frozen_tokens=1)
    grads = {}
    for weight in (0.0, 3.0):
        own, kept = (make_batch(r, tok.pad_token_id, student.device) for r in (rows[3:5], rows[:3]))
        own.beside = kept.beside = (*pkv, True)
        own.keep, own.quiet, own.quiet_by = (kept, 1.0), weight, "mass"
        ours.zero_grad()
        out = distill_loss(student, ours, own)
        out.loss.backward()
        assert (out.quiet is None) == (weight == 0.0) and (weight == 0.0 or 0.0 < out.quiet < 1.0)
        grads[weight] = [p.grad.clone() for p in (*ours.trainable_keys, *ours.trainable_values)]
    half = len(grads[0.0]) // 2
    assert torch.allclose(grads[0.0][-1], grads[3.0][-1], rtol=1e-4, atol=1e-7)  # the last layer's values
    assert all(not torch.allclose(a, b, rtol=1e-3) for a, b in zip(grads[0.0][:half], grads[3.0][:half]))


def test_the_ratio_term_is_our_loudness_to_their_rows_over_ours(student, tok):
    """by="ratio": the loudness to the partner's rows over the loudness to our own rows, both read beside the
    partner - so halving every value of ours leaves it (nearly: the softmax over the rest moves little) unchanged."""
    pkv = student.prefill(document_ids(tok, PARTNER)[:24])
    rows = keep_rows(student, tok, PARTNER, pkv, 24, top_k=8)
    ours = TrainableKV(*student.prefill(document_ids(tok, DOC_A)[:8]), frozen_tokens=1)
    got = {}
    for by in ("loudness", "ratio"):
        own, kept = (make_batch(r, tok.pad_token_id, student.device) for r in (rows[3:5], rows[:3]))
        own.beside = kept.beside = (*pkv, False)
        own.keep, own.quiet, own.quiet_by = (kept, 0.0), 1.0, by
        got[by] = distill_loss(student, ours, own).quiet
        with torch.no_grad(), measured(student.model, *ours.span(own.beside), own.where) as mine:
            student.log_probs(*ours.full(own.beside), own.ids, own.where, share=False)
        if by == "ratio":
            assert got["ratio"] == pytest.approx(got["loudness"] / float(mine.mean()), rel=1e-4)
    assert 0.0 < got["ratio"] < 10.0


@pytest.mark.parametrize("by", ["loudness", "mass", "ratio"])
def test_training_quiet_lowers_our_loudness_to_the_partners_rows(student, tok, tmp_path, by):
    """The same steps with and without the term: with it, our KV ends quieter to the partner's rows (by its own
    measure: loudness, or the attention mass our keys get)."""
    pkv = student.prefill(document_ids(tok, PARTNER)[:24])
    rows = keep_rows(student, tok, PARTNER, pkv, 24, top_k=8)
    convs = keep_rows(student, tok, DOC_A, student.prefill(document_ids(tok, DOC_A)[:24]), 24, top_k=8)
    start = student.prefill(document_ids(tok, DOC)[:8])
    probe = make_batch(convs[:4], tok.pad_token_id, student.device)  # our rows: the ratio's denominator
    probe.beside = (*pkv, True)
    probe.keep, probe.quiet = (make_batch(rows, tok.pad_token_id, student.device), 0.0), 1.0
    probe.quiet_by = by
    loud = {}
    for weight in (0.0, 5.0):
        ours = TrainableKV(*start, frozen_tokens=1)
        cfg = TrainConfig(tokens=8, steps=10, batch=2, lr=0.05, beside=1.0, quiet=weight, quiet_by=by)
        history = train(student, ours, convs, cfg, tok.pad_token_id, tmp_path / f"q{weight}.ckpt", progress=False,
                        log=lambda _: None, partners=[Partner(*pkv, rows)])
        assert all(("quiet" in rec) == bool(weight) for rec in history)
        probe.keep[0].beside = probe.beside
        loud[weight] = distill_loss(student, ours, probe).quiet
    assert loud[5.0] < 0.8 * loud[0.0]


def test_bad_quiet_settings_are_named():
    for cfg in (TrainConfig(tokens=8, quiet=1.0), TrainConfig(tokens=8, beside=0.5, quiet=-1.0),
                TrainConfig(tokens=8, beside=0.5, quiet=float("inf")),
                TrainConfig(tokens=8, beside=0.5, quiet=1.0, quiet_by="volume")):
        with pytest.raises(CartridgeError, match="quiet"):
            cfg.check()


def test_cli_learn_quiet_partner_records_it_and_a_resume_must_match(tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(DOC)
    args = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "8", "--out",
            str(tmp_path / "c.pt"), "--batch", "2", "--beside", "1", "--model", TINY, "--quiet"]
    assert main(args + ["--steps", "4", "--quiet-partner", "2"]) == 0
    assert json.loads((tmp_path / "c.pt.manifest.json").read_text())["labels"]["quiet"] == "2.0"
    assert main(args + ["--steps", "6", "--quiet-partner", "2"]) == 0  # resumed with the same settings
    capsys.readouterr()
    assert main(args + ["--steps", "8", "--quiet-partner", "1"]) != 0  # another weight is another run
    assert main(args[:-5] + ["--beside", "0", "--model", TINY, "--quiet", "--steps", "2", "--quiet-partner", "1",
                             "--out", str(tmp_path / "d.pt")]) != 0
    assert "quiet" in capsys.readouterr().err


def test_cli_quiet_by_mass_is_labelled_and_needs_the_term(tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(DOC)
    args = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "8", "--batch", "2", "--beside",
            "1", "--model", TINY, "--quiet", "--steps", "2", "--quiet-by", "mass"]
    assert main(args + ["--out", str(tmp_path / "c.pt"), "--quiet-partner", "1"]) == 0
    labels = json.loads((tmp_path / "c.pt.manifest.json").read_text())["labels"]
    assert labels["quiet"] == "1.0" and labels["quiet_by"] == "mass"
    capsys.readouterr()
    assert main(args + ["--out", str(tmp_path / "d.pt")]) != 0  # --quiet-by alone would change nothing: refused
    assert "--quiet-by has no effect without --quiet-partner" in capsys.readouterr().err
