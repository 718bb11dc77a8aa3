"""Trained cartridges on the tiny model: self-study synthesis through InferenceEngine (resumable JSONL), context
distillation (loss falls, resumes, checkpoints), the saved file in the cartridges repo's layout read by final's
loader, served by generate(cartridge=...) and `final serve` with the logits the training forward computed, and the
KL evaluation. Real engine, real HF model, real files; a few seconds each."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
import torch.nn as nn

from cartridges_helpers import TINY
from serve_helpers import DOC_A, spec
from final.training.rows import read_conversations
from final.cartridges.format import load_cartridge
from final.training.onpolicy.selfstudy import SynthConfig, synthesize
from final.training.student import Student, TrainableKV
from final.training.train import TrainConfig, checkpoint_path, initial_ids, train_cartridge
from final.errors import CartridgeError
from final.models import resolve_model_path
from final.prompts import continuation_ids

pytest_plugins = ["serve_helpers"]  # the served fixture
P = 8
SMALL = dict(batch=2, min_chunk_tokens=16, max_chunk_tokens=16, question_tokens=6, answer_tokens=6, top_k=5)


@pytest.fixture(scope="module")
def inference():
    from final.inf import local_engine

    engine = local_engine(TINY, dtype="float32")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def data(inference, tmp_path_factory):
    path = tmp_path_factory.mktemp("synth") / "convs.jsonl"
    assert synthesize(inference, DOC_A, path, SynthConfig(count=4, **SMALL), progress=False) == 4
    return path


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "doc_a.pt"
    summary = train_cartridge(TINY, data, out, TrainConfig(tokens=P, steps=6, batch=4, lr=5e-2), text=DOC_A,
                              progress=False)
    return out, summary


def test_synth_rows_hold_the_teacher_and_resume(inference, data):
    from final.training.onpolicy.selfstudy import system_text

    tok = inference.tokenizer
    rows = read_conversations(data, len(tok))
    assert [r.id for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert r.prompt_ids == continuation_ids(tok, [{"role": "user", "content": r.question}])
        # every token after the system turn but the first is a target (the repo's supervision)
        assert r.target_start == 1 and len(r.top_ids) == len(r.prompt_ids) + len(r.answer_ids) - 1
        assert all(len(t) == 5 for t in r.top_ids)
        # at T=0 the teacher's most likely token at each answer target is the answer's token
        assert [t[0] for t in r.top_ids[r.answer_targets()]] == r.answer_ids
        assert r.seed_type and r.chunk[1] - r.chunk[0] == 16
    # the chunk was served as a cartridge: the teacher's greedy answer is the one with the chunk as text, in the
    # repo's system-prompt template
    doc = tok(DOC_A, add_special_tokens=False).input_ids
    r = rows[0]
    system = system_text(tok.decode(doc[r.chunk[0]:r.chunk[1]]))
    text = inference.generate([[{"role": "system", "content": system}, {"role": "user", "content": r.question}]],
                              temperature=0, max_tokens=6)
    assert text.token_ids[0] == r.answer_ids
    # a rerun with a larger count writes only the missing rows
    assert synthesize(inference, DOC_A, data, SynthConfig(count=6, **SMALL), progress=False) == 2
    assert [r.id for r in read_conversations(data, len(tok))] == list(range(6))


def test_training_lowers_the_loss_and_saves_the_repo_layout(trained):
    from final.cartridges.manifest import manifest_path, read_manifest, verify_checksum

    out, summary = trained
    cart = load_cartridge(out)
    assert (cart.num_tokens, cart.num_frozen_tokens, cart.dtype) == (P, 1, torch.float32)
    with torch.serialization.safe_globals([nn.ParameterList]):
        raw = torch.load(out, weights_only=True)
    # the names TrainableCache.save writes and its from_pretrained requires (fixed_*, not frozen_*)
    assert sorted(raw) == ["fixed_keys", "fixed_values", "trainable_keys", "trainable_values"]
    assert all(isinstance(v, nn.ParameterList) and len(v) == cart.num_layers for v in raw.values())
    assert raw["trainable_keys"][0].shape == (1, cart.num_kv_heads, P - 1, cart.head_dim)
    assert raw["fixed_values"][0].shape == (1, cart.num_kv_heads, 1, cart.head_dim)
    # the frozen sink is the init's first token, untouched; the trainable part moved away from the init
    student = Student(resolve_model_path(TINY))
    keys, _ = student.prefill(initial_ids(student_tokenizer(), DOC_A, P))
    assert torch.equal(cart.keys[0][:, :, :1], keys[0][:, :, :1])
    assert not torch.allclose(cart.keys[0][:, :, 1:], keys[0][:, :, 1:])
    manifest = read_manifest(manifest_path(out))
    verify_checksum(out, manifest)
    assert manifest.positions == "after_prefix" and manifest.num_tokens == P


def student_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(TINY))


def test_served_logits_equal_the_training_forward(inference, trained, data):
    out, _ = trained
    cart = load_cartridge(out)
    student = Student(resolve_model_path(TINY))
    row = read_conversations(data, student.vocab_size)[0]
    ids = row.prompt_ids + row.answer_ids
    with torch.no_grad():
        trained_lp = student.log_probs(cart.keys, cart.values, torch.tensor([ids]), torch.ones(1, len(ids), dtype=bool))
    cid = inference.load_cartridge(id="trained-a", path=str(out))
    prefix = inference.engine.prefixes.get((cid,))
    logits, _ = inference.engine.call(lambda r: r.forward_full(ids, prefix))
    assert (torch.log_softmax(logits, -1) - trained_lp).abs().max().item() < 1e-4
    # generate(cartridge=...) picks the tokens, with the logprobs, the training forward gives them
    gen = inference.generate([row.prompt_ids], cartridge=cid, temperature=0, max_tokens=5, logprobs=True)
    new = gen.token_ids[0]
    with torch.no_grad():
        lp = student.log_probs(cart.keys, cart.values, torch.tensor([row.prompt_ids + new]),
                               torch.arange(len(row.prompt_ids) + len(new))[None] >= len(row.prompt_ids) - 1)
    want = lp[:len(new)].gather(1, torch.tensor(new)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(gen.metadata[0]["logprobs"]), want, atol=1e-4)
    assert new == lp[:len(new)].argmax(-1).tolist()
    inference.unload_cartridge(cid)


def test_final_serve_serves_a_trained_file(served, trained):
    out, _ = trained
    with httpx.Client(base_url=served.url, timeout=120) as http:
        body = {"model": "m", "messages": [{"role": "user", "content": "Who keeps the lighthouse?"}],
                "max_tokens": 6, "temperature": 0, "cartridges": [spec(out)]}
        r = http.post("/custom/cartridge/chat/completions", json=body)
    assert r.status_code == 200, r.text
    local = served.inference.generate([{"role": "user", "content": "Who keeps the lighthouse?"}],
                                      cartridge=[spec(out)], temperature=0, max_tokens=6)
    assert r.json()["choices"][0]["message"]["content"] == local.completions[0]
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == P


def test_resume_continues_the_same_run(data, tmp_path):
    cfg = dict(tokens=P, batch=2, lr=5e-2, checkpoint_every=1)
    straight = tmp_path / "straight.pt"
    train_cartridge(TINY, data, straight, TrainConfig(steps=4, **cfg), text=DOC_A, progress=False)
    resumed = tmp_path / "resumed.pt"
    train_cartridge(TINY, data, resumed, TrainConfig(steps=2, **cfg), text=DOC_A, progress=False)
    summary = train_cartridge(TINY, data, resumed, TrainConfig(steps=4, **cfg), text=DOC_A, progress=False)
    state = torch.load(checkpoint_path(resumed), weights_only=True)
    assert len(state["history"]) == 4 and summary["steps"] == 4
    a, b = load_cartridge(straight), load_cartridge(resumed)
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a.keys + a.values, b.keys + b.values))
    # a checkpoint of other settings is refused, not mixed in
    with pytest.raises(CartridgeError) as err:
        train_cartridge(TINY, data, resumed, TrainConfig(steps=5, **{**cfg, "lr": 1e-3}), text=DOC_A,
                        progress=False)
    assert err.value.field == "checkpoint"


def test_eval_orders_the_conditions(inference, data):
    """A cartridge that is the teacher's own context scores ~0, below the first p tokens, below no document."""
    from final.cartridges.build import build_from_text
    from final.training.evaluate.heldout import evaluate, table
    from final.prompts import document_ids

    doc = document_ids(inference.tokenizer, DOC_A)
    convs = read_conversations(data, len(inference.tokenizer))[:2]
    exact = build_from_text(inference.engine, doc)
    rows = evaluate(inference.engine, inference.tokenizer, doc[:len(doc)], exact, convs)
    names = [r.condition for r in rows]
    assert names == ["no document", f"first {len(doc)} tokens", "cartridge"]
    assert rows[2].kl == pytest.approx(0.0, abs=1e-5) and rows[2].top1 == 1.0
    # at p = 8 the cartridge (the first 8 tokens) equals the first-p baseline, and both sit below no document
    first8 = type(exact)([k[:, :, :P] for k in exact.keys], [v[:, :, :P] for v in exact.values], 1)
    rows8 = evaluate(inference.engine, inference.tokenizer, doc, first8, convs)
    assert rows8[1].kl == pytest.approx(rows8[2].kl, abs=1e-6) and rows8[2].kl > rows[2].kl
    assert rows8[0].kl > 0 and rows8[2].kv_bytes == rows8[1].kv_bytes
    assert f"| cartridge | {P} |" in table(rows8)


def test_cli_workflow(tmp_path, capsys):
    from final.cartridge_commands import main

    doc = tmp_path / "doc.txt"
    doc.write_text(DOC_A)
    common = ["--model", TINY, "--text", str(doc)]
    small = ["--batch", "2", "--chunk-tokens", "16", "--question-tokens", "4", "--answer-tokens", "4"]
    assert main(["cartridge", "synth", *common, *small, "--count", "2", "--out", str(tmp_path / "c.jsonl")]) == 0
    assert main(["cartridge", "synth", *common, *small, "--count", "2", "--seed", "1",
                 "--out", str(tmp_path / "h.jsonl")]) == 0
    assert main(["cartridge", "train", *common, "--data", str(tmp_path / "c.jsonl"), "--tokens", "4", "--steps", "2",
                 "--out", str(tmp_path / "c.pt"), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["cartridge", "eval", str(tmp_path / "c.pt"), *common, "--data", str(tmp_path / "h.jsonl"),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["condition"] for r in report["rows"]][2] == "cartridge" and report["conversations"] == 2


@pytest.mark.parametrize("line, field", [
    ("not json", "line 1"),
    ('{"id": 0, "prompt_ids": [1], "answer_ids": [2]}', "top_ids"),
    ('{"id": 0, "prompt_ids": [99999999], "answer_ids": [2], "top_ids": [[2]], "top_logprobs": [[-0.1]]}',
     "prompt_ids"),
    ('{"id": 0, "prompt_ids": [1], "answer_ids": [2, 3], "top_ids": [[2]], "top_logprobs": [[-0.1]]}', "top_ids"),
    ('{"id": 0, "prompt_ids": [1], "answer_ids": [2], "top_ids": [[2]], "top_logprobs": [[0.5]]}', "top_logprobs"),
])
def test_bad_conversation_rows_name_the_field(tmp_path, line, field):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(CartridgeError) as err:
        read_conversations(path, 1000)
    assert err.value.field == field and str(path) in str(err.value)


def test_bad_settings_are_typed_errors(tmp_path):
    with pytest.raises(CartridgeError) as err:
        read_conversations(tmp_path / "missing.jsonl", 10)
    assert err.value.field == "data"
    for kwargs, field in ((dict(tokens=0), "tokens"), (dict(tokens=4, frozen_tokens=4), "frozen_tokens"),
                          (dict(tokens=4, lr=float("nan")), "lr"), (dict(tokens=4, steps=0), "steps")):
        with pytest.raises(CartridgeError) as err:
            TrainConfig(**kwargs).check()
        assert err.value.field == field
    with pytest.raises(CartridgeError) as err:
        initial_ids(student_tokenizer(), "short", 500)
    assert err.value.field == "text"
    with pytest.raises(CartridgeError) as err:
        SynthConfig(count=0).check()
    assert err.value.field == "count"
    with pytest.raises(CartridgeError) as err:
        SynthConfig(seed_types=("poetry",)).check()
    assert err.value.field == "seed_types"


def test_trainable_kv_keeps_the_frozen_part_out_of_the_optimizer():
    keys = [torch.randn(1, 2, 5, 4) for _ in range(2)]
    cache = TrainableKV(keys, [k + 1 for k in keys], frozen_tokens=1)
    trainable = [p for p in cache.parameters() if p.requires_grad]
    assert len(trainable) == 4 and all(p.shape[2] == 4 for p in trainable)
    full_k, full_v = cache.full()
    assert torch.equal(full_k[1], keys[1]) and torch.equal(full_v[0], keys[0] + 1)


def test_key_lr_zero_trains_the_values_alone(data, tmp_path):
    """--key-lr 0 keeps the start's keys (the same after one step and after three) while the values move; at the
    default both move, and a share outside [0, inf) is refused by name."""
    def run(name: str, steps: int, key_lr: float):
        out = tmp_path / f"{name}.pt"
        train_cartridge(TINY, data, out, TrainConfig(tokens=P, steps=steps, batch=2, lr=5e-2, key_lr=key_lr),
                        text=DOC_A, progress=False)
        return load_cartridge(out)

    one, three = run("k0_1", 1, 0.0), run("k0_3", 3, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(one.keys, three.keys))
    assert not all(torch.equal(a, b) for a, b in zip(one.values, three.values))
    one, three = run("k1_1", 1, 1.0), run("k1_3", 3, 1.0)
    assert not all(torch.equal(a, b) for a, b in zip(one.keys, three.keys))
    with pytest.raises(CartridgeError) as err:
        TrainConfig(tokens=P, key_lr=-1.0).check()
    assert err.value.field == "key_lr"


def test_key_lr_share_puts_the_keys_in_their_own_group():
    from final.training.trainer import _groups

    keys = [torch.randn(1, 2, 5, 4) for _ in range(2)]
    cache = TrainableKV(keys, [k + 1 for k in keys], frozen_tokens=1)
    groups = _groups(cache, 0.5)
    assert [len(g["params"]) for g in groups] == [2, 2] and groups[1]["scale"] == 0.5
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in cache.trainable_keys}
    assert [len(g["params"]) for g in _groups(cache, 1.0)] == [4]
    assert [len(g["params"]) for g in _groups(cache, 0.0)] == [2] and not cache.trainable_keys[0].requires_grad


def test_average_writes_the_mean_of_the_last_steps_and_keeps_the_last_to_resume(data, tmp_path):
    """--average 0.5 over 4 steps writes the mean of the cartridges after steps 3 and 4 (each the same as a run that
    stopped there: the lr is constant and the batches depend on the step alone); the checkpoint keeps step 4's, a
    rerun writes the same average, and a resume whose window would start elsewhere is refused by name."""
    def run(name: str, steps: int, average: float = 0.0):
        out = tmp_path / f"{name}.pt"
        train_cartridge(TINY, data, out, TrainConfig(tokens=P, steps=steps, batch=2, lr=5e-2, average=average),
                        text=DOC_A, progress=False)
        return out, load_cartridge(out)

    _, three = run("three", 3)
    _, four = run("four", 4)
    out, avg = run("avg", 4, 0.5)
    for a, b, m in zip(three.keys + three.values, four.keys + four.values, avg.keys + avg.values):
        assert torch.allclose(m, (a + b) / 2, atol=1e-6)
    assert not all(torch.equal(m, b) for m, b in zip(avg.values, four.values))
    last = torch.load(checkpoint_path(out), weights_only=True)["cache"]
    assert torch.equal(last["trainable_values.0"], four.values[0][:, :, 1:])
    _, again = run("avg", 4, 0.5)  # the run is done: the average is read back from the checkpoint
    assert all(torch.equal(a, b) for a, b in zip(avg.keys + avg.values, again.keys + again.values))
    with pytest.raises(CartridgeError) as err:  # 8 steps at 0.5 average from step 5: steps 3-4 cannot be used
        run("avg", 8, 0.5)
    assert err.value.field == "average"
    with pytest.raises(CartridgeError) as err:
        TrainConfig(tokens=P, average=1.5).check()
    assert err.value.field == "average"
