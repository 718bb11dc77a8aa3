"""`final cartridge distill` (the on-policy loop) and the faithfulness fixes of off-policy training (issue 27),
on the tiny model: real engine, real HF student, real files; a few seconds each."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cartridges_helpers import TINY
from serve_helpers import DOC_A
from final.training.rows import Conversation, dedupe, read_conversations
from final.training.onpolicy.loop import DistillConfig, distill
from final.training.onpolicy.selfstudy import SynthConfig, synthesize, system_text
from final.training.losses import distill_loss
from final.training.student import Student, TrainableKV
from final.training.train import TrainConfig, make_batch, train_cartridge
from final.errors import CartridgeError
from final.models import resolve_model_path
from final.prompts import document_ids

from test_cartridges_train import SMALL, data, inference  # noqa: F401  (the same module fixtures, one rule)

QUICK = SynthConfig(min_chunk_tokens=16, max_chunk_tokens=24, question_tokens=6)


@pytest.fixture(scope="module")
def student():
    return Student(resolve_model_path(TINY))


def test_a_cache_of_the_teachers_own_context_has_zero_kl_and_the_teachers_entropy_as_loss(inference, data,
                                                                                          student):
    """The reference a broken target would fail: a cartridge that *is* the teacher's context (the chunk in its
    system turn) gives KL ~ 0, and the loss is the teacher's top-k entropy."""
    tok = inference.tokenizer
    row = read_conversations(data, len(tok))[0]
    doc = tok(DOC_A, add_special_tokens=False).input_ids
    ids = document_ids(tok, system_text(tok.decode(doc[row.chunk[0]:row.chunk[1]])))
    cache = TrainableKV(*student.prefill(ids), frozen_tokens=1)
    with torch.no_grad():
        out = distill_loss(student, cache, make_batch([row], tok.pad_token_id, student.device))
    p = torch.tensor(row.top_logprobs)
    entropy = float(-(p.exp() * p).sum(-1).mean())
    assert out.forward_kl == pytest.approx(0.0, abs=2e-4)
    assert out.loss.item() == pytest.approx(entropy, abs=2e-4)
    # and a cache of another text does not
    other = TrainableKV(*student.prefill(document_ids(tok, "An unrelated note about tides.")), frozen_tokens=1)
    with torch.no_grad():
        assert distill_loss(student, other, make_batch([row], tok.pad_token_id, student.device)).forward_kl > 0.01


def test_training_lowers_the_loss_on_the_same_batch(data, student, tmp_path):
    from transformers import AutoTokenizer

    from final.training.train import initial_ids

    tok = AutoTokenizer.from_pretrained(resolve_model_path(TINY))
    rows = read_conversations(data, student.vocab_size)
    batch = make_batch(rows, tok.pad_token_id, student.device)
    init = TrainableKV(*student.prefill(initial_ids(tok, DOC_A, 8)), frozen_tokens=1)
    out = tmp_path / "c.pt"
    summary = train_cartridge(TINY, data, out, TrainConfig(tokens=8, steps=6, batch=4, lr=5e-2), text=DOC_A,
                              progress=False)
    from final.cartridges.format import load_cartridge

    cart = load_cartridge(out)
    trained = TrainableKV(cart.keys, cart.values, frozen_tokens=1)
    with torch.no_grad():
        before, after = distill_loss(student, init, batch), distill_loss(student, trained, batch)
    assert after.loss.item() < before.loss.item() and after.forward_kl < before.forward_kl
    assert 0 <= summary["last_kl"] <= summary["last_loss"]  # the KL is the loss less the teacher's entropy


def test_a_torn_last_line_is_cut_before_a_resume_appends(inference, tmp_path):
    path = tmp_path / "c.jsonl"
    synthesize(inference, DOC_A, path, SynthConfig(count=2, **SMALL), progress=False)
    with open(path, "a") as fh:
        fh.write('{"id": 2, "prompt_ids": [1, 2')  # a run killed mid-write
    assert synthesize(inference, DOC_A, path, SynthConfig(count=4, **SMALL), progress=False) == 2
    assert [r.id for r in read_conversations(path, len(inference.tokenizer))] == [0, 1, 2, 3]


def test_steps_below_the_checkpoint_are_refused_not_saved_under_a_smaller_count(data, tmp_path):
    cfg = dict(tokens=8, batch=2, lr=5e-2, checkpoint_every=1)
    out = tmp_path / "c.pt"
    train_cartridge(TINY, data, out, TrainConfig(steps=3, **cfg), text=DOC_A, progress=False)
    before = out.read_bytes()
    with pytest.raises(CartridgeError) as err:
        train_cartridge(TINY, data, out, TrainConfig(steps=2, **cfg), text=DOC_A, progress=False)
    assert err.value.field == "steps" and out.read_bytes() == before


def test_eval_serves_a_from_zero_cartridge_in_its_convention(inference, data, tmp_path, capsys):
    """The same tensors declared after_prefix and from_zero (manifest) score differently, as they are served."""
    from final.cartridges.build import build_from_text
    from final.cartridges.format import save_cartridge
    from final.cartridges.manifest import CartridgeManifest
    from final.cartridge_commands import main

    tok = inference.tokenizer
    cart = build_from_text(inference.engine, document_ids(tok, DOC_A)[:8])
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC_A)
    rows = {}
    for positions in ("after_prefix", "from_zero"):
        path = save_cartridge(cart, tmp_path / positions / "c.pt")
        CartridgeManifest.describe(cart, path, cartridge_id="c", model_id=TINY, positions=positions).write(path)
        assert main(["cartridge", "eval", str(path), "--model", TINY, "--text", str(doc), "--data", str(data),
                     "--json"]) == 0
        rows[positions] = json.loads(capsys.readouterr().out)["rows"]
    # after_prefix: the file is the document's first 8 tokens, served as they are
    assert rows["after_prefix"][2]["kl"] == pytest.approx(rows["after_prefix"][1]["kl"], abs=1e-6)
    # from_zero: the keys are rotated at load as serving does, so the same tensors score otherwise
    assert abs(rows["from_zero"][2]["kl"] - rows["after_prefix"][2]["kl"]) > 1e-4


def test_held_out_rows_are_deduplicated_against_training_questions():
    row = lambda i, q: Conversation(i, [1, 2], [3], [[3]], [[0.0]], question=q)  # noqa: E731
    kept = dedupe([row(0, "Who keeps  the light?"), row(1, "who keeps the light?"), row(2, "When?"),
                   row(3, "What year?")], ["WHEN?"])
    assert [r.id for r in kept] == [0, 3]


def run_distill(inference, out, on_step=None, on_start=None, **kw):
    cfg = DistillConfig(**{**dict(tokens=8, steps=2, questions=2, n=2, answer_tokens=6, top_k=5, lr=5e-2,
                                  init="prefix", validate=0, checkpoint_every=1, synth=QUICK), **kw})
    return distill(inference, DOC_A, out, cfg, model=TINY, dtype="float32", progress=False, on_step=on_step,
                   on_start=on_start)


def killed_after(steps):
    def on_step(rec, cache):
        if rec["step"] == steps:
            raise KeyboardInterrupt
    return on_step


def test_distill_steps_rewrite_the_cartridge_and_resume_the_same_run(inference, tmp_path):
    from final.cartridges.format import load_cartridge

    straight = run_distill(inference, tmp_path / "a.pt", steps=3)
    assert [r["step"] for r in straight] == [1, 2, 3]
    for r in straight:
        assert r["reverse_kl"] is not None and r["forward_kl"] >= 0 and r["targets"] > 0
        assert all(r[k] >= 0 for k in ("question_s", "rollout_s", "teacher_s", "gradient_s", "sync_s"))
    # the default schedule: cosine from lr to 0 over the budget, set at every step
    assert [r["lr"] for r in straight] == pytest.approx([5e-2, 5e-2 * 0.75, 5e-2 * 0.25])
    resumed = tmp_path / "b.pt"
    with pytest.raises(KeyboardInterrupt):
        run_distill(inference, resumed, steps=3, on_step=killed_after(2))
    assert len(run_distill(inference, resumed, steps=3)) == 3
    a, b = load_cartridge(tmp_path / "a.pt"), load_cartridge(resumed)
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a.keys + a.values, b.keys + b.values))
    # a larger budget continues the run on the stretched curve
    grown = run_distill(inference, resumed, steps=4)
    assert len(grown) == 4 and grown[-1]["lr"] == pytest.approx(5e-2 * 0.5 * (1 + math.cos(math.pi * 3 / 4)))
    init = document_ids(inference.tokenizer, DOC_A)[:8]
    assert not torch.allclose(a.keys[0][:, :, 1:], build(inference, init).keys[0][:, :, 1:])
    # the student's cartridge is not left in the engine; the teacher's neither
    assert not [c for c in inference.cartridge_ids() if c.startswith("__distill")]


def build(inference, ids):
    from final.cartridges.build import build_from_text

    return build_from_text(inference.engine, ids)


@pytest.mark.parametrize("loss", ["reverse_k1", "reverse_k3"])
def test_reverse_losses_and_mixed_rows(inference, tmp_path, loss):
    history = run_distill(inference, tmp_path / "c.pt", steps=1, questions=2, loss=loss, on_policy_fraction=0.5)
    assert torch.isfinite(torch.tensor(history[0]["loss"])) and history[0]["reverse_kl"] is not None


def test_more_updates_per_step_move_the_cartridge_further_on_the_same_rows(inference, tmp_path):
    from final.cartridges.format import load_cartridge

    init = build(inference, document_ids(inference.tokenizer, DOC_A)[:8])
    one, four = tmp_path / "one.pt", tmp_path / "four.pt"
    a = run_distill(inference, one, steps=1, on_policy_fraction=0.0)
    b = run_distill(inference, four, steps=1, on_policy_fraction=0.0, updates=4)
    assert a[0]["loss"] == pytest.approx(b[0]["loss"], abs=1e-5)  # the record is the rows as they came
    moved = [float((c.keys[0][:, :, 1:] - init.keys[0][:, :, 1:]).norm()) for c in map(load_cartridge, (one, four))]
    assert moved[1] > moved[0] > 0


def test_the_tail_bucket_kl_is_a_true_kl_where_the_top_k_one_goes_below_zero():
    from final.training.losses import Targets, forward_topk, forward_topk_tail, step_loss

    teacher = torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, 0.0, 0.0, 0.0]]), -1)
    sharper = torch.log_softmax(torch.tensor([[4.0, 3.0, 2.0, -2.0, -2.0, -2.0]]), -1)  # the tail moved up top
    full_kl = float((teacher.exp() * (teacher - sharper)).sum())

    def targets(k):
        top = teacher.topk(k, -1)
        none = torch.zeros(1)
        return Targets(top.indices, top.values, none.long(), none, none.bool())

    assert float(forward_topk(sharper, targets(3))[1]) < 0 < float(forward_topk_tail(sharper, targets(3))[1])
    assert float(forward_topk_tail(sharper, targets(3))[1]) <= full_kl + 1e-5  # the data processing inequality
    assert float(forward_topk_tail(sharper, targets(6))[1]) == pytest.approx(full_kl, abs=1e-5)  # k = V: the KL
    assert float(forward_topk_tail(teacher, targets(3))[1]) == pytest.approx(0.0, abs=1e-6)
    out = step_loss("forward_topk_tail", sharper.requires_grad_(), targets(3))
    assert out.loss.item() == pytest.approx(out.tail_kl) and out.tail_kl > 0 > out.forward_kl


def test_out_holds_the_best_cartridge_validation_judged_and_the_best_survives_a_resume(inference, tmp_path):
    """A far too large lr makes every step worse on the validation set: OUT ends as the start, said so."""
    from final.cartridges.format import load_cartridge
    from final.cartridges.manifest import manifest_path, read_manifest

    out, starts = tmp_path / "v.pt", []
    kw = dict(validate=2, lr=50.0, schedule="constant", on_policy_fraction=0.0)
    first = run_distill(inference, out, steps=1, on_start=lambda done, cache: starts.append(cache.cartridge()),
                        **kw)
    assert len(first[0]["questions"]) == 2 + 2  # the validation set's questions, then the step's
    assert first[0]["validation_kl"] > first[0]["start_validation_kl"] >= 0 and first[0]["validation_set_s"] > 0
    kept = load_cartridge(out)
    assert all(torch.equal(a, b) for a, b in zip(kept.keys + kept.values, starts[0].keys + starts[0].values))
    assert read_manifest(manifest_path(out)).labels["kept_step"] == "0"
    resumed = run_distill(inference, out, steps=2, **kw)  # the checkpoint carries the best: the start again
    assert "start_validation_kl" not in resumed[1] and resumed[1]["validation_kl"] > first[0]["start_validation_kl"]
    kept = load_cartridge(out)
    assert all(torch.equal(a, b) for a, b in zip(kept.keys + kept.values, starts[0].keys + starts[0].values))


def test_off_policy_rows_only_have_no_reverse_kl(inference, tmp_path):
    history = run_distill(inference, tmp_path / "c.pt", steps=1, on_policy_fraction=0.0)
    assert history[0]["reverse_kl"] is None and history[0]["forward_kl"] >= 0


@pytest.mark.parametrize("kw, field", [
    (dict(tokens=0), "tokens"), (dict(loss="kl"), "loss"), (dict(on_policy_fraction=1.5), "on_policy_fraction"),
    (dict(temperature=0.0), "temperature"), (dict(rollout="vllm"), "rollout"), (dict(questions=0), "questions"),
    (dict(tokens=4, frozen_tokens=4), "frozen_tokens"), (dict(schedule="linear"), "schedule"),
    (dict(validate=-1), "validate"),
])
def test_bad_distill_settings_name_the_field(kw, field):
    with pytest.raises(CartridgeError) as err:
        DistillConfig(**{"tokens": 8, **kw}).check()
    assert err.value.field == field


def test_cli_distill(tmp_path, capsys):
    from final.cartridge_commands import main

    doc = tmp_path / "doc.txt"
    doc.write_text(DOC_A)
    out = tmp_path / "d.pt"
    assert main(["cartridge", "distill", "--model", TINY, "--text", str(doc), "--tokens", "8", "--out", str(out),
                 "--steps", "1", "--questions", "2", "--answer-tokens", "4", "--question-tokens", "4",
                 "--chunk-tokens", "16-24", "--top-k", "4", "--init-questions", "2", "--validate", "2",
                 "--quiet"]) == 0
    said = capsys.readouterr().out
    assert "over 1 steps" in said and "holds the best judged, after step" in said and out.is_file()
    manifest = json.loads(out.with_name(out.name + ".manifest.json").read_text())
    assert manifest["labels"]["init"] == "match"  # the default start, recorded with the file


def test_the_training_benches_print_the_tables_results_md_shows():
    """bench/RESULTS.md's per-stage cost table and KL-vs-time table are what the reproduce commands print."""
    import argparse
    import importlib.util
    from pathlib import Path

    def load(name: str):
        path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    args = argparse.Namespace(train_count=48, heldout_count=12, tokens=[64], steps=24, batch=4)
    cost = load("cartridge_train").cost_table({"synth_train": 570.0, "train_p64": 1098.0, "eval_p64": 120.0}, args)
    assert "| stage | what | wall time |" in cost and "| train_p64 | 24 steps x 4 conversations | 18.3 min |" in cost
    assert cost.strip().endswith("| total | | 29.8 min |")
    args = argparse.Namespace(tokens=64, questions=8)
    point = {"step": 10, "wall_s": 379.8, "no document": 0.2719, "first_p": 0.1727, "cartridge": 0.1665}
    kl = load("cartridge_distill").report({"off": {"points": [point], "step_cost_s": dict.fromkeys(
        ("question_s", "rollout_s", "teacher_s", "gradient_s", "sync_s", "init_s"), 1.0)}}, args)
    assert "| off | 10 | 379.8 | 0.2719 | 0.1727 | 0.1665 | 0.96x |" in kl
    assert "| off | 1.0 | 1.0 | 1.0 | 1.0 | 1.0 | | 1.0 |" in kl
