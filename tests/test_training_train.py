"""Trained cartridges on the tiny model: the off-policy trainer over rows (loss falls, resumes, checkpoints), the
saved file in the cartridges repo's layout read by final's loader, served by generate(cartridge=...) and
`final serve` with the logits the training forward computed, and `final cartridge train` on the command line.
Real engine, real HF model, real files; a few seconds each."""

from __future__ import annotations

import httpx
import pytest
import torch
import torch.nn as nn
from transformers import AutoTokenizer

from cartridges_helpers import TINY
from serve_helpers import DOC_A, spec
from final.cartridge_commands import main
from final.cartridges.format import load_cartridge
from final.cartridges.manifest import manifest_path, read_manifest, verify_checksum
from final.errors import CartridgeError
from final.models import resolve_model_path
from final.training.rows import read_conversations
from final.training.settings import TrainConfig
from final.training.start.initial import initial_ids
from final.training.student import Student, TrainableKV
from final.training.train import train_cartridge
from final.training.trainer import checkpoint_path

from training_helpers import data, inference  # noqa: F401  (the module's engine and DOC_A's fact rows)

pytest_plugins = ["serve_helpers"]  # the served fixture
P = 8


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("trained") / "doc_a.pt"
    summary = train_cartridge(TINY, data, out, TrainConfig(tokens=P, steps=6, batch=4, lr=5e-2), text=DOC_A,
                              progress=False)
    return out, summary


def test_training_lowers_the_loss_and_saves_the_repo_layout(trained):
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
    return AutoTokenizer.from_pretrained(resolve_model_path(TINY))


def test_served_logits_equal_the_training_forward(inference, trained, data):  # noqa: F811
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


def test_resume_continues_the_same_run(data, tmp_path):  # noqa: F811
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


def test_cli_train_on_rows_you_have(data, tmp_path, capsys):  # noqa: F811
    """`train` takes rows and a settings file; without --text the KV starts as the first row's first P tokens."""
    settings = tmp_path / "s.yaml"
    settings.write_text("batch: 2\nlr: 0.05\n")
    out = tmp_path / "c.pt"
    assert main(["cartridge", "train", "--data", str(data), "--tokens", "4", "--steps", "2", "--out", str(out),
                 "--model", TINY, "--quiet", "--settings", str(settings)]) == 0
    assert "over 2 steps" in capsys.readouterr().out
    assert read_manifest(manifest_path(out)).labels["init"] == "data"
    settings.write_text("beside: 0.5\n")  # training beside partners is learn's: its partner texts come with it
    assert main(["cartridge", "train", "--data", str(data), "--tokens", "4", "--out", str(tmp_path / "d.pt"),
                 "--model", TINY, "--quiet", "--settings", str(settings)]) != 0
    assert "beside" in capsys.readouterr().err


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


def test_trainable_kv_keeps_the_frozen_part_out_of_the_optimizer():
    keys = [torch.randn(1, 2, 5, 4) for _ in range(2)]
    cache = TrainableKV(keys, [k + 1 for k in keys], frozen_tokens=1)
    trainable = [p for p in cache.parameters() if p.requires_grad]
    assert len(trainable) == 4 and all(p.shape[2] == 4 for p in trainable)
    full_k, full_v = cache.full()
    assert torch.equal(full_k[1], keys[1]) and torch.equal(full_v[0], keys[0] + 1)
