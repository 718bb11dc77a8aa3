"""`final cartridge distill` (the on-policy loop) and what every training shares (the teacher's own context as
the cache gives KL 0, resumes, checkpoints), on the tiny model: real engine, real HF student, real files."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cartridges_helpers import TINY
from serve_helpers import DOC_A
from final.cartridge_commands import main
from final.cartridges.build import build_from_text
from final.cartridges.format import load_cartridge, save_cartridge
from final.cartridges.manifest import CartridgeManifest, manifest_path, read_manifest
from final.errors import CartridgeError
from final.prompts import document_ids
from final.training.losses import Targets, distill_loss, forward_topk, forward_topk_tail, step_loss
from final.training.onpolicy.loop import distill
from final.training.rows import Conversation, append, read_conversations
from final.training.settings import DistillConfig, SynthConfig, TrainConfig
from final.training.start.initial import initial_ids
from final.training.student import TrainableKV
from final.training.teacher import teacher_ids
from final.training.train import make_batch, train_cartridge

from training_helpers import data, inference, student, tok  # noqa: F401  (the module's fixtures)

QUICK = SynthConfig(min_chunk_tokens=16, max_chunk_tokens=24, question_tokens=6)


def test_a_cache_of_the_teachers_own_context_has_zero_kl_and_the_teachers_entropy_as_loss(inference, data,
                                                                                          student):
    """The reference a broken target would fail: a cartridge that *is* the teacher's context (the document as its
    system turn) gives KL ~ 0, and the loss is the teacher's top-k entropy."""
    tok = inference.tokenizer
    row = read_conversations(data, len(tok))[0]
    cache = TrainableKV(*student.prefill(teacher_ids(tok, DOC_A)), frozen_tokens=1)
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


def test_training_lowers_the_loss_on_the_same_batch(data, student, tok, tmp_path):
    rows = read_conversations(data, student.vocab_size)
    batch = make_batch(rows, tok.pad_token_id, student.device)
    init = TrainableKV(*student.prefill(initial_ids(tok, DOC_A, 8)), frozen_tokens=1)
    out = tmp_path / "c.pt"
    summary = train_cartridge(TINY, data, out, TrainConfig(tokens=8, steps=6, batch=4, lr=5e-2), text=DOC_A,
                              progress=False)
    cart = load_cartridge(out)
    trained = TrainableKV(cart.keys, cart.values, frozen_tokens=1)
    with torch.no_grad():
        before, after = distill_loss(student, init, batch), distill_loss(student, trained, batch)
    assert after.loss.item() < before.loss.item() and after.forward_kl < before.forward_kl
    assert 0 <= summary["last_kl"] <= summary["last_loss"]  # the KL is the loss less the teacher's entropy


def test_a_torn_last_line_is_cut_before_the_next_rows_are_appended(tmp_path):
    path = tmp_path / "c.jsonl"
    row = lambda i: Conversation(i, [1, 2], [3], [[3]], [[0.0]])  # noqa: E731
    append(path, [row(0), row(1)])
    with open(path, "a") as fh:
        fh.write('{"id": 2, "prompt_ids": [1, 2')  # a run killed mid-write
    append(path, [row(2), row(3)])
    assert [r.id for r in read_conversations(path, 10)] == [0, 1, 2, 3]


def test_steps_below_the_checkpoint_are_refused_not_saved_under_a_smaller_count(data, tmp_path):
    cfg = dict(tokens=8, batch=2, lr=5e-2, checkpoint_every=1)
    out = tmp_path / "c.pt"
    train_cartridge(TINY, data, out, TrainConfig(steps=3, **cfg), text=DOC_A, progress=False)
    before = out.read_bytes()
    with pytest.raises(CartridgeError) as err:
        train_cartridge(TINY, data, out, TrainConfig(steps=2, **cfg), text=DOC_A, progress=False)
    assert err.value.field == "steps" and out.read_bytes() == before


QA = {"id": "a1", "split": "tune", "question": "Who keeps the lighthouse?", "choices": ["Mara Quill", "Pip", "Jot"],
      "answer": 0, "reference": "Mara Quill", "support": "Mara Quill"}


def test_eval_serves_a_from_zero_cartridge_in_its_convention(inference, tmp_path, capsys):
    """The same tensors declared after_prefix and from_zero (manifest) score differently, as they are served."""
    tok = inference.tokenizer
    cart = build_from_text(inference.engine, document_ids(tok, DOC_A)[:8])
    (tmp_path / "doc.txt").write_text(DOC_A)
    (tmp_path / "doc.jsonl").write_text(json.dumps(QA) + "\n")
    kl = {}
    for positions in ("after_prefix", "from_zero"):
        path = save_cartridge(cart, tmp_path / positions / "c.pt")
        CartridgeManifest.describe(cart, path, cartridge_id="c", model_id=TINY, positions=positions).write(path)
        assert main(["cartridge", "eval", str(path), "--model", TINY, "--qa", str(tmp_path / "doc.jsonl"),
                     "--json"]) == 0
        kl[positions] = {r["condition"]: r["kl"] for r in json.loads(capsys.readouterr().out)["qa"]["rows"]}
    # after_prefix: the file is the document's first 8 tokens, served as they are
    assert kl["after_prefix"]["cartridge"] == pytest.approx(kl["after_prefix"]["first 8 tokens"], abs=1e-6)
    # from_zero: the keys are rotated at load as serving does, so the same tensors score otherwise
    assert abs(kl["from_zero"]["cartridge"] - kl["after_prefix"]["cartridge"]) > 1e-4


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
    straight = run_distill(inference, tmp_path / "a.pt", steps=3)
    assert [r["step"] for r in straight] == [1, 2, 3]
    for r in straight:
        assert r["forward_kl"] >= 0 and r["tail_kl"] >= 0 and r["targets"] > 0
        assert all(r[k] >= 0 for k in ("question_s", "rollout_s", "teacher_s", "gradient_s", "sync_s"))
    # the schedule: cosine from lr to 0 over the budget, set at every step
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
    return build_from_text(inference.engine, ids)


def test_the_tail_bucket_kl_is_a_true_kl_where_the_top_k_one_goes_below_zero():
    teacher = torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, 0.0, 0.0, 0.0]]), -1)
    sharper = torch.log_softmax(torch.tensor([[4.0, 3.0, 2.0, -2.0, -2.0, -2.0]]), -1)  # the tail moved up top
    full_kl = float((teacher.exp() * (teacher - sharper)).sum())

    def targets(k):
        top = teacher.topk(k, -1)
        return Targets(top.indices, top.values)

    assert float(forward_topk(sharper, targets(3))[1]) < 0 < float(forward_topk_tail(sharper, targets(3))[1])
    assert float(forward_topk_tail(sharper, targets(3))[1]) <= full_kl + 1e-5  # the data processing inequality
    assert float(forward_topk_tail(sharper, targets(6))[1]) == pytest.approx(full_kl, abs=1e-5)  # k = V: the KL
    assert float(forward_topk_tail(teacher, targets(3))[1]) == pytest.approx(0.0, abs=1e-6)
    out = step_loss("forward_topk_tail", sharper.requires_grad_(), targets(3))
    assert out.loss.item() == pytest.approx(out.tail_kl) and out.tail_kl > 0 > out.forward_kl


def test_out_holds_the_best_cartridge_validation_judged_and_the_best_survives_a_resume(inference, tmp_path):
    """A far too large lr makes every step worse on the validation set: OUT ends as the start, said so."""
    out, starts = tmp_path / "v.pt", []
    kw = dict(validate=2, lr=50.0)
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


@pytest.mark.parametrize("kw, field", [
    (dict(tokens=0), "tokens"), (dict(init="first"), "init"), (dict(temperature=0.0), "temperature"),
    (dict(rollout="vllm"), "rollout"), (dict(questions=0), "questions"), (dict(tokens=4, frozen_tokens=4),
                                                                           "frozen_tokens"),
    (dict(validate=-1), "validate"), (dict(synth=SynthConfig(min_chunk_tokens=64, max_chunk_tokens=32)),
                                      "chunk_tokens"),
])
def test_bad_distill_settings_name_the_field(kw, field):
    with pytest.raises(CartridgeError) as err:
        DistillConfig(**{"tokens": 8, **kw}).check()
    assert err.value.field == field


def test_cli_distill_takes_its_settings_from_a_file(tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC_A)
    settings = tmp_path / "s.yaml"
    settings.write_text("questions: 2\nanswer_tokens: 4\ntop_k: 4\ninit_questions: 2\nvalidate: 2\n"
                        "synth: {min_chunk_tokens: 16, max_chunk_tokens: 24, question_tokens: 4}\n")
    out = tmp_path / "d.pt"
    args = ["cartridge", "distill", "--model", TINY, "--text", str(doc), "--tokens", "8", "--out", str(out),
            "--steps", "1", "--quiet", "--settings", str(settings)]
    assert main(args) == 0
    said = capsys.readouterr().out
    assert "over 1 steps" in said and "holds the best judged, after step" in said and out.is_file()
    manifest = json.loads(out.with_name(out.name + ".manifest.json").read_text())
    assert manifest["labels"]["init"] == "match"  # the default start, recorded with the file
    for bad, key in (("steps: 3\n", "steps"), ("updates: 2\n", "updates"), ("synth: {chunk: 3}\n", "synth.chunk"),
                     ("questions: two\n", "questions")):  # a flag's, a removed one, a nested one, a wrong type
        settings.write_text(bad)
        assert main(args) != 0
        assert f"key '{key}'" in capsys.readouterr().err
