"""On-policy fact rows (final/distill/live.py) and `final cartridge learn --on-policy`: the cartridge being trained
answers the fact questions itself (real engine, tiny model), each answer scored by its row's own teacher window."""

from __future__ import annotations

import json

import pytest
import torch

from cartridges_helpers import TINY
from final.cartridge_commands import main
from final.training.document.facts import FactConfig, end_of_turn, fact_prompts, fact_rows
from final.training.teacher import teacher_window
from final.training.live import LiveConfig, LiveFacts
from final.training.teacher import ChunkContext
from final.training.student import Student, TrainableKV
from final.training.train import TrainConfig, train
from final.errors import CartridgeError
from final.models import resolve_model_path

from test_cartridges_train import inference  # noqa: F401  (the module's engine fixture)
from test_distill_facts import DOC

FACTS = FactConfig(kinds=("quote", "ask"), teacher_tokens=16, top_k=4)


@pytest.fixture(scope="module")
def student():
    return Student(resolve_model_path(TINY))


def _cache(student, inference, shift: float = 0.0) -> TrainableKV:
    keys, values = student.prefill(inference.tokenizer("Brennock Ferry notes", add_special_tokens=False).input_ids)
    return TrainableKV([k + shift for k in keys], values, frozen_tokens=1)


def test_live_rows_are_the_carts_own_samples_scored_by_each_rows_teacher_window(inference, student):
    live = LiveFacts(inference, DOC, FACTS, LiveConfig(temperature=1.0, answer_tokens=6))
    tok, end = inference.tokenizer, end_of_turn(inference.tokenizer)
    prompts = fact_prompts(DOC, FACTS)
    try:
        for shift in (0.0, 0.5):  # two caches: each step samples with the cache it is handed, not a stale one
            cache = _cache(student, inference, shift)
            rows, info = live.rows(3, 4, cache)
            assert [r.id for r in rows] == live.pick(3, 4) and len(set(live.pick(3, 4))) == 4
            assert live.pick(3, 4) != live.pick(4, 4) and info["rollout_s"] >= 0 and len(info["samples"]) == 4
            inference.cartridges.add("__again", cache.cartridge(), pin=True)
            again = inference.generate([r.prompt_ids for r in rows], cartridge="__again", temperature=1.0,
                                       max_tokens=6, seed=3).rows()
            inference.cartridges.unpin("__again")
            inference.unload_cartridge("__again")
            for row, got in zip(rows, again):
                said = [t for t in got.output_ids if t != end]
                assert row.answer_ids == (said + [end] if got.finish_reason == "stop" else said or [end])
                assert row.sampled and row.target_start == len(row.prompt_ids)
                assert len(row.top_ids) == len(row.answer_ids) == len(row.token_logprobs)
                fp = prompts[row.id]
                assert row.question == fp.question and row.seed_type == f"live-{fp.kind}"
                with ChunkContext(inference, teacher_window(tok, DOC, fp.span, 16), "__check") as ctx:
                    (tops, lps), = ctx.teacher_scores([row.prompt_ids], [row.answer_ids], 4)
                start = len(row.prompt_ids)
                assert [[t for t, _ in top] for top in tops[start - 1:]] == row.top_ids
                assert all(abs(a - b) < 1e-4 for a, b in zip(lps[start - 1:], row.token_logprobs))
    finally:
        live.close()
    assert "__learn-student" not in (inference.cartridge_ids() or [])


def test_train_mixes_the_on_policy_share_into_each_step_and_trains_on_it(inference, student, tmp_path):
    live = LiveFacts(inference, DOC, FACTS, LiveConfig(answer_tokens=5))
    convs = fact_rows(inference, DOC, FactConfig(kinds=("cloze",), top_k=4))
    asked: list[int] = []
    real_rows = live.rows

    def rows(step, count, cache):
        asked.append(count)
        return real_rows(step, count, cache)

    live.rows = rows
    cache = _cache(student, inference)
    before = [p.detach().clone() for p in cache.trainable_keys]
    pad = inference.tokenizer.eos_token_id
    cfg = TrainConfig(tokens=cache.frozen_keys[0].shape[2] + cache.trainable_keys[0].shape[2], steps=2, batch=4,
                      lr=0.05, on_policy=0.5)
    try:
        hist = train(student, cache, convs, cfg, pad, tmp_path / "c.ckpt", progress=False, live=live)
    finally:
        live.close()
    assert asked == [2, 2] and all("rollout_s" in h and len(h["samples"]) == 2 for h in hist)
    assert any(not torch.equal(a, b) for a, b in zip(before, cache.trainable_keys))
    with pytest.raises(CartridgeError, match="on_policy"):
        train(student, cache, convs, cfg, pad, tmp_path / "d.ckpt", progress=False)
    with pytest.raises(CartridgeError, match="on_policy"):
        TrainConfig(tokens=8, on_policy=1.5).check()


def test_cli_learn_on_policy_trains_and_its_flags_are_checked(tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(DOC)
    out = tmp_path / "c.pt"
    args = ["cartridge", "learn", "--text", str(tmp_path / "doc.txt"), "--tokens", "8", "--out", str(out),
            "--steps", "2", "--batch", "2", "--beside", "0", "--model", TINY, "--quiet"]
    assert main(args + ["--on-policy", "0.5", "--sample-tokens", "4", "--sample-temperature", "0.7"]) == 0
    manifest = json.loads((tmp_path / "c.pt.manifest.json").read_text())
    assert manifest["labels"]["on_policy"] == "0.5"
    history = torch.load(tmp_path / "c.pt.ckpt", weights_only=True)["history"]
    assert all(len(h["samples"]) == 1 for h in history)
    capsys.readouterr()
    assert main(args + ["--sample-tokens", "4"]) != 0  # a sampling setting with nothing sampled: named
    assert "sample_tokens" in capsys.readouterr().err
    assert main(args + ["--on-policy", "0.5", "--sample-temperature", "0"]) != 0
    assert "sample_temperature" in capsys.readouterr().err
    # a checkpoint trained with on-policy rows is not resumed as a run without them
    assert main(args + ["--steps", "3"]) != 0
    assert "on_policy" in capsys.readouterr().err
    # nor with its answers sampled otherwise
    more = args + ["--steps", "3", "--on-policy", "0.5", "--sample-temperature", "0.7", "--sample-tokens"]
    assert main(more + ["5"]) != 0
    assert "live" in capsys.readouterr().err
    assert main(more + ["4"]) == 0  # the same settings resume
