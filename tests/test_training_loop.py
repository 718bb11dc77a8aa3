"""The on-policy loop's review findings (issue 42), on the tiny model with the real engine and the real HF student:
one teacher (the document as the system turn), keep-best where a later step beats the start, `kept_step` when the
last step is the best, and engine-mode samples drawn from the cartridge the previous step wrote."""

from __future__ import annotations

import pytest
import torch

from serve_helpers import DOC_A
from final.cartridges.format import load_cartridge
from final.cartridges.manifest import manifest_path, read_manifest
from final.training.teacher import teacher_ids
from final.prompts import continuation_ids

from training_helpers import inference  # noqa: F401  (the module's engine fixture)
from test_training_onpolicy import run_distill


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))


def test_a_cartridge_of_the_whole_document_turn_is_the_teacher(inference, tmp_path):
    """The teacher is the document as the system turn: a `prefix` start as long as that turn is the teacher's own
    KV, so validation judges it at ~0 KL (with the repo's template around the document it was not)."""
    p = len(teacher_ids(inference.tokenizer, DOC_A))
    history = run_distill(inference, tmp_path / "t.pt", steps=1, tokens=p, validate=2)
    assert history[0]["start_validation_kl"] == pytest.approx(0.0, abs=2e-4)


def test_out_holds_a_later_step_that_beats_the_start_and_its_manifest_says_which(inference, tmp_path):
    """A start of an unrelated text that training improves: OUT must end as the best step judged (not the start),
    the file the one that step wrote, and the manifest must name the step, also when it is the last."""
    out, carts = tmp_path / "b.pt", {}
    history = run_distill(inference, out, steps=3, validate=2, lr=5e-2,
                          on_start=lambda done, cache: carts.__setitem__(0, cache.cartridge()),
                          on_step=lambda rec, cache: carts.__setitem__(rec["step"], cache.cartridge()))
    kls = [history[0]["start_validation_kl"]] + [r["validation_kl"] for r in history]
    best = min(range(len(kls)), key=kls.__getitem__)
    assert best > 0, f"no step beat the start: {kls}"  # the case a never-replacing keep-best fails
    assert history[-1]["kept_step"] == best
    assert same(load_cartridge(out), carts[best]) and not same(load_cartridge(out), carts[0])
    assert read_manifest(manifest_path(out)).labels["kept_step"] == str(best)


def test_the_manifest_names_the_kept_step_when_the_last_step_is_the_best(inference, tmp_path):
    out = tmp_path / "l.pt"
    history = run_distill(inference, out, steps=1, validate=2, lr=5e-2)
    assert history[0]["validation_kl"] < history[0]["start_validation_kl"]  # the one step is the best
    assert read_manifest(manifest_path(out)).labels["kept_step"] == "1" == str(history[-1]["kept_step"])


def test_engine_mode_samples_come_from_the_cartridge_the_previous_step_wrote(inference, tmp_path):
    """Step 2's student samples equal a fresh generate (same prompts, seed, n) behind step 1's cartridge, and not
    behind the start's: the in-memory sync reached the sampler."""
    carts = {}
    history = run_distill(inference, tmp_path / "s.pt", steps=2, lr=0.5,
                          on_start=lambda done, cache: carts.__setitem__(0, cache.cartridge()),
                          on_step=lambda rec, cache: carts.__setitem__(rec["step"], cache.cartridge()))
    tok = inference.tokenizer
    rec = history[1]
    prompts = [continuation_ids(tok, [{"role": "user", "content": q}]) for q in rec["questions"]]
    seed = 1 * 1009 + 1  # step_rows: cfg.seed * 1_000_003 + step * 1009, the rollout's is that + 1

    def samples(cart):
        inference.cartridges.add("__probe", cart)
        try:
            out = inference.generate(prompts, cartridge="__probe", n=2, temperature=1.0, max_tokens=6, seed=seed)
        finally:
            inference.unload_cartridge("__probe")
        return [list(ids) for ids in out.token_ids]

    assert rec["samples"] == samples(carts[1])
    assert rec["samples"] != samples(carts[0])
