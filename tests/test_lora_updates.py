"""A trainer's LoRA adapter through update_weights (final/adapters/merge.py) on the embedded engine: the served
weight of every adapted module is its kept base + scale * B @ A, so greedy answers and log-probs are HF + PEFT's
after each adapter update (never merged twice); veRL's forms (PEFT-saved names + its LoraConfig, base_layer-named
base syncs) work; a bad adapter update is refused whole, naming the tensor, with weights and version unchanged;
a plain update after adapters serves exactly its own tensors."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config
from final.errors import WeightsError
from lora_helpers import ADAPTERS, hf_rows, peft_model
from weights_helpers import PROMPTS

MAX = 10
ATOL = 1e-4


@pytest.fixture()
def engine():
    from final.inf import InferenceEngine

    with InferenceEngine(tiny_config()) as eng:
        yield eng


def rows(engine, prompts=PROMPTS):
    out = engine.generate(prompts, temperature=0, max_tokens=MAX, logprobs=True)
    return [(ids, m["logprobs"]) for ids, m in zip(out.token_ids, out.metadata)]


def assert_serves(engine, model):
    want = hf_rows(model, engine.prepare(PROMPTS).ids, MAX, engine.eos_token_ids[0])
    for (ids, lps), (ref_ids, ref_lps) in zip(rows(engine), want, strict=True):
        assert ids == ref_ids
        assert lps == pytest.approx(ref_lps, abs=ATOL)


def weights_of(engine):
    names = sorted(engine.engine.parameter_shapes())
    return engine.engine.current_weights(names)


def same_weights(a, b):
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def lora_state(model):
    """What veRL's actor sends after its first sync: peft's get_peft_model_state_dict (PEFT's saved names)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def train_step(model, seed):
    """An optimizer step's worth of change to the adapter's tensors (the base stays frozen, as under LoRA)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.25)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_adapter_updates_serve_hf_and_peft_every_step(engine, tiny_dir, name):
    model = peft_model(tiny_dir, 3, **ADAPTERS[name])
    base = rows(engine)
    start = engine.weights_version
    assert engine.update_weights(model) == start + 1  # a PeftModel: its adapter and config
    assert_serves(engine, model)
    assert rows(engine) != base
    for step in range(2):  # recomputed from the kept base each time: merged twice, it would drift away
        train_step(model, step)
        assert engine.update_weights(lora_state(model), peft_config=model.peft_config["default"]) == start + 2 + step
        assert_serves(engine, model)


def test_verls_two_phase_sync_base_first_then_adapters_only(tiny_dir):
    """veRL with load_format dummy: the base first (base_layer names, peft_config, base_sync_done False), then
    the adapter's tensors only, straight into LocalRollout.update_weights as veRL's FSDP worker calls it."""
    import asyncio

    from final.inf import InferenceEngine

    model = peft_model(tiny_dir, 5, **ADAPTERS["all"])
    config = model.peft_config["default"]
    base_sync = {k.removeprefix("base_model.model."): v.detach().clone() for k, v in model.state_dict().items()
                 if "lora_" not in k}
    assert any(".base_layer." in k for k in base_sync)
    with InferenceEngine(tiny_config()) as eng:
        rollout = eng.rollout
        asyncio.run(rollout.update_weights(iter(base_sync.items()), peft_config=config, base_sync_done=False))
        asyncio.run(rollout.update_weights(iter(lora_state(model).items()), peft_config=config, base_sync_done=True))
        assert_serves(eng, model)


def test_a_base_sync_under_an_adapter_keeps_the_adapter_on_the_new_base(engine, tiny_dir):
    model = peft_model(tiny_dir, 6, **ADAPTERS["qvd"])
    engine.update_weights(model)
    gen = torch.Generator().manual_seed(9)
    new_base = {}
    with torch.no_grad():
        for k, p in model.named_parameters():
            if ".base_layer." in k and "layers.0" in k:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.25)
                new_base[k.removeprefix("base_model.model.")] = p.detach().clone()
    engine.update_weights(new_base)  # `.base_layer.` names: the base under the adapter
    assert_serves(engine, model)


def test_a_plain_update_after_adapters_serves_exactly_its_tensors(engine, tiny_dir):
    from transformers import AutoModelForCausalLM

    before = weights_of(engine)
    base_rows = rows(engine)
    engine.update_weights(peft_model(tiny_dir, 7, **ADAPTERS["mlp"]))
    engine.update_weights(peft_model(tiny_dir, 8, **ADAPTERS["all"]))  # replaces it: mlp's modules back to base
    assert not same_weights(before, weights_of(engine))
    engine.update_weights(AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32))
    assert same_weights(before, weights_of(engine))
    assert rows(engine) == base_rows


def test_an_adapter_replacing_another_restores_the_modules_it_drops(engine, tiny_dir):
    first = peft_model(tiny_dir, 10, **ADAPTERS["mlp"])  # o, k, gate, up
    second = peft_model(tiny_dir, 11, **ADAPTERS["qvd"])  # q, v, down
    engine.update_weights(first)
    engine.update_weights(second)
    assert_serves(engine, second)


_A = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
_B = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize("edit, words", [
    (lambda s: s.__setitem__(_A, s[_A][:, :-1]), "q_proj.lora_A.weight.*shape"),
    (lambda s: s.__setitem__(_B, s[_B][:-1]), "q_proj.lora_B.weight.*shape"),
    (lambda s: s.__setitem__(_A, torch.cat([s[_A], s[_A]])), f"{_B}.*rank 4, its lora_A 8"),
    (lambda s: s.__setitem__(_A.replace("layers.1", "layers.9"), s[_A]), "layers.9.*not a module"),
    (lambda s: s.__setitem__(_A.replace("self_attn.q_proj", "input_layernorm"), s[_A]), "input_layernorm"),
    (lambda s: s.pop(_B), "q_proj.lora_A.weight.*no lora_B"),
    (lambda s: s[_B].__setitem__((0, 0), float("inf")), "q_proj.lora_B.weight.*NaN or Inf"),
], ids=["A-shape", "B-shape", "rank", "unknown-layer", "not-a-projection", "lone-A", "inf"])
def test_a_bad_adapter_update_is_refused_whole_naming_the_tensor(engine, tiny_dir, edit, words):
    good = peft_model(tiny_dir, 12, **ADAPTERS["all"])
    engine.update_weights(good)
    before, version, served = weights_of(engine), engine.weights_version, rows(engine)
    bad = peft_model(tiny_dir, 13, **ADAPTERS["all"])
    state = lora_state(bad)
    edit(state)
    with pytest.raises(WeightsError, match=words):
        engine.update_weights(state, peft_config=bad.peft_config["default"])
    assert engine.weights_version == version and same_weights(before, weights_of(engine))
    assert rows(engine) == served  # the good adapter still serves
    train_step(good, 1)  # and the kept base is untouched: the next update is exact
    engine.update_weights(lora_state(good), peft_config=good.peft_config["default"])
    assert_serves(engine, good)


def test_adapter_tensors_without_their_config_are_refused(engine, tiny_dir):
    state = lora_state(peft_model(tiny_dir, 14, **ADAPTERS["all"]))
    with pytest.raises(WeightsError, match="peft_config"):
        engine.update_weights(state)
    assert engine.weights_version == 0


def test_an_adapter_folder_is_an_update_too(engine, tiny_dir, tmp_path):
    model = peft_model(tiny_dir, 15, **ADAPTERS["qvd"])
    model.save_pretrained(str(tmp_path / "ad"))
    engine.update_weights(tmp_path / "ad")
    assert_serves(engine, model)
