"""InferenceEngine.update_weights on the real SGLang on CPU (tests/sglang_cpu: only the compiled kernels stood in):
veRL 0.6.0's own SGLangRollout.update_weights into SGLang 0.5.2 on the verl06 lane; SGLang 0.5.12's
update_weights_from_tensor on the verl09 lane (these tests, collected by tests/sglang_direct_weight_cases.py).
After an update greedy answers are HF generate's on the updated model; a bad update reaches SGLang not at all;
injected cartridges made for the old weights are unloaded (and their reserved ids freed) unless kept."""

from __future__ import annotations

import pytest
import torch

from final import compat
from sglang_helpers import CPU_ARGS, TINY, use_sglang_cpu
from weights_helpers import PROMPTS, hf_greedy, perturbed, state_of

MAX = 10


def sglang_engine():
    use_sglang_cpu()
    from final.inf import InferenceEngine

    return InferenceEngine({"model_path": TINY, "progress": False, "rollout": {
        "name": "sglang", "dtype": "float32", "prompt_length": 64, "response_length": 16,
        "engine_kwargs": {"sglang": dict(CPU_ARGS)}}})


@pytest.fixture(scope="module")
def engine():
    if compat.LANE != "verl06":
        pytest.skip("the verl09 lane runs these in tests/sglang_direct_weight_cases.py (a process of its own)")
    with sglang_engine() as eng:
        yield eng


def greedy(engine):
    out = engine.generate(PROMPTS, temperature=0, max_tokens=MAX)
    return out.token_ids, {m["weights_version"] for m in out.metadata}


def test_full_and_partial_updates_answer_as_hf_generate(engine, tiny_dir):
    ids = engine.prepare(PROMPTS).ids
    before, version = greedy(engine)
    trained = perturbed(tiny_dir, scale=0.5, seed=31)
    v = engine.update_weights(trained)
    after, versions = greedy(engine)
    assert versions == {v} and v == min(version) + 1 and after != before
    assert after == hf_greedy(trained, ids, MAX)
    one_layer = perturbed(tiny_dir, scale=2.0, seed=32, only="layers.1.self_attn")
    engine.update_weights(state_of(one_layer, "layers.1.self_attn"))
    merged = perturbed(tiny_dir, scale=0.0)
    merged.load_state_dict({**trained.state_dict(), **state_of(one_layer, "layers.1.self_attn")})
    assert greedy(engine)[0] == hf_greedy(merged, ids, MAX)


def test_a_bad_update_reaches_sglang_not_at_all(engine, tiny_dir):
    from final.errors import WeightsError

    before = engine.generate(PROMPTS, temperature=0, max_tokens=MAX, logprobs=True)
    good = perturbed(tiny_dir, scale=0.5, seed=33).state_dict()
    for bad, name in (({**good, "model.layers.0.mlp.up_proj.weight": torch.zeros(4)},
                       "model.layers.0.mlp.up_proj.weight"),
                      ({"model.norm.weight": torch.full((64,), float("nan"))}, "model.norm.weight"),
                      ({"model.layers.0.mlp.gate.weight": torch.zeros(1)}, "model.layers.0.mlp.gate.weight")):
        with pytest.raises(WeightsError) as exc:
            engine.update_weights(bad)
        assert exc.value.parameter == name
    after = engine.generate(PROMPTS, temperature=0, max_tokens=MAX, logprobs=True)
    assert after.token_ids == before.token_ids
    # SGLang 0.5.12 keeps the prompts in its radix cache: a second identical call reads their KV from it and its
    # logprobs differ from the first's by ~1e-6 with or without an update (0.5.2 is flushed by veRL: exact)
    for a, b in zip(after.metadata, before.metadata):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
    assert {m["weights_version"] for m in after.metadata} == {m["weights_version"] for m in before.metadata}


def test_cartridges_are_unloaded_by_an_update_unless_kept(engine, tiny_dir):
    from cartridges_helpers import random_cart
    from final.errors import CartridgeError

    original = perturbed(tiny_dir, scale=0.0)
    engine.update_weights(original)
    engine.cartridges.add("c1", random_cart(tokens=8, seed=1))
    kept = engine.generate("hi", cartridge="c1", temperature=0, max_tokens=4).token_ids
    engine.update_weights(original, keep_cartridges=True)  # the same weights, the cartridge kept: re-injected
    assert engine.generate("hi", cartridge="c1", temperature=0, max_tokens=4).token_ids == kept
    engine.update_weights(original)
    assert engine.cartridge_ids() == [] and engine.rollout.cartridge_target.cartridge_ids() == []
    with pytest.raises(CartridgeError, match="weights version"):
        engine.generate("hi", cartridge="c1", temperature=0, max_tokens=4)
    engine.cartridges.add("c1", random_cart(tokens=8, seed=1))  # loaded again explicitly: served
    assert engine.generate("hi", cartridge="c1", temperature=0, max_tokens=4).token_ids == kept


def test_release_and_resume_then_serve(engine):
    before = greedy(engine)
    engine.release()
    assert greedy(engine) == before  # resumed by itself
    engine.release()
    engine.resume()
    assert greedy(engine) == before


def test_a_trainers_adapter_is_merged_and_sent_as_weights(engine, tiny_dir):
    """veRL's LoRA sync on SGLang: the base under the adapter (base_layer names, as veRL's first sync sends it),
    then adapters only, each merged into that base here and sent as the adapted modules' weights; SGLang answers
    as HF + PEFT. An adapter whose base this process cannot know (every parameter rewritten by a plain update) is
    refused naming the tensor; per-request adapters are refused naming the lane."""
    from final.errors import UnsupportedError, WeightsError
    from lora_helpers import ADAPTERS, hf_rows, peft_model

    engine.update_weights(perturbed(tiny_dir, scale=0.0))  # the original weights, but sent: unknown here
    model = peft_model(tiny_dir, 34, **ADAPTERS["qvd"])
    config = model.peft_config["default"]
    with pytest.raises(WeightsError, match="base"):
        engine.update_weights(model)
    base = {k.removeprefix("base_model.model."): v for k, v in model.state_dict().items() if "lora_" not in k}
    engine.update_weights(base, peft_config=config)
    ids = engine.prepare(PROMPTS).ids
    for step in range(2):
        engine.update_weights(model)
        assert greedy(engine)[0] == [tokens for tokens, _ in hf_rows(model, ids, MAX, engine.eos_token_ids[0])]
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(-1.0)
    with pytest.raises(UnsupportedError) as err:
        engine.generate("hi", adapter="any")
    assert err.value.field == "adapter" and err.value.backend == "sglang"
