"""InferenceEngine.update_weights / release / resume / weights_version on the embedded engine
(docs/guides/train-a-policy.md): after an update greedy answers are HF generate's on the updated model, in every weight layout
the engine keeps; a bad update changes nothing and names the parameter; calls never see two versions; cartridges
made for the old weights are not served silently."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conftest import TINY, tiny_config
from final.errors import CartridgeError, EngineError, UnsupportedError, WeightsError
from weights_helpers import PROMPTS, hf_greedy, perturbed, save_policy, state_of

MAX = 12


@pytest.fixture(scope="module")
def engine():
    from final.inf import InferenceEngine

    with InferenceEngine(tiny_config()) as eng:
        yield eng


@pytest.fixture(scope="module")
def trained(tiny_dir):
    return perturbed(tiny_dir, scale=0.5, seed=1)


def greedy(engine, prompts=PROMPTS):
    # from an empty prefix cache, so that equal weights give bit-identical numbers (a hit moves them ~1e-6)
    engine.engine.flush_cache()
    out = engine.generate(prompts, temperature=0, max_tokens=MAX, logprobs=True)
    return out.token_ids, [m["logprobs"] for m in out.metadata], [m["weights_version"] for m in out.metadata]


def ids_of(engine, prompts=PROMPTS):
    return engine.prepare(prompts).ids


def test_a_full_update_serves_the_trained_model_and_counts_a_version(engine, trained):
    start = engine.weights_version
    before, _, versions = greedy(engine)
    assert versions == [start] * len(PROMPTS)
    assert engine.update_weights(trained) == start + 1 == engine.weights_version
    after, _, versions = greedy(engine)
    assert after != before and versions == [start + 1] * len(PROMPTS)
    assert after == hf_greedy(trained, ids_of(engine), MAX)


@pytest.mark.parametrize("form", ["generator", "state_dict", "folder", "file"])
def test_every_update_form_gives_the_same_weights(tiny_dir, trained, tmp_path, form):
    from final.inf import InferenceEngine
    from final.weights import save_weights

    if form == "folder":
        trained.save_pretrained(tmp_path / "m", safe_serialization=True)
        weights = tmp_path / "m"
    elif form == "file":
        weights = save_weights(list(trained.state_dict().items()), tmp_path / "w.safetensors")
    elif form == "generator":  # veRL's: (HF name, tensor) pairs made on demand
        weights = ((k, v) for k, v in trained.state_dict().items())
    else:
        weights = trained.state_dict()
    with InferenceEngine(tiny_config()) as eng:
        eng.update_weights(weights)
        assert greedy(eng)[0] == hf_greedy(trained, ids_of(eng), MAX)


def test_a_partial_update_changes_only_what_it_names(tiny_dir):
    from final.inf import InferenceEngine

    layer_mlp = perturbed(tiny_dir, scale=2.0, seed=2, only="layers.1.mlp")
    with InferenceEngine(tiny_config()) as eng:
        before = greedy(eng)[0]
        eng.update_weights(state_of(layer_mlp, "layers.1.mlp"))  # gate, up and down of one layer
        after = greedy(eng)[0]
        assert after != before and after == hf_greedy(layer_mlp, ids_of(eng), MAX)
        q_only = perturbed(tiny_dir, scale=2.0, seed=3, only="layers.0.self_attn.k_proj")
        eng.update_weights({"model.layers.0.self_attn.k_proj.weight":
                            q_only.state_dict()["model.layers.0.self_attn.k_proj.weight"]})
        merged = perturbed(tiny_dir, scale=0.0)  # the engine now holds layer_mlp's MLP and q_only's k_proj
        merged.load_state_dict({**merged.state_dict(), **state_of(layer_mlp, "layers.1.mlp"),
                                **state_of(q_only, "layers.0.self_attn.k_proj")})
        assert greedy(eng)[0] == hf_greedy(merged, ids_of(eng), MAX)


def _bad_updates(trained) -> list[tuple[dict, str]]:
    full = trained.state_dict()
    wrong_shape = dict(full)  # the bad tensor sits in the middle of an otherwise good update
    wrong_shape["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    nan = dict(full)
    nan["model.layers.1.self_attn.v_proj.weight"] = full["model.layers.1.self_attn.v_proj.weight"].clone()
    nan["model.layers.1.self_attn.v_proj.weight"][0, 0] = float("nan")
    inf = {"model.norm.weight": torch.full_like(full["model.norm.weight"], float("inf"))}
    ints = {"model.layers.0.input_layernorm.weight": torch.ones_like(full["model.layers.0.input_layernorm.weight"],
                                                                     dtype=torch.long)}
    unknown = {**full, "model.layers.0.mlp.upp_proj.weight": torch.zeros(1)}
    past = {"model.layers.99.mlp.up_proj.weight": full["model.layers.0.mlp.up_proj.weight"]}
    return [(wrong_shape, "model.layers.1.mlp.up_proj.weight"), (nan, "model.layers.1.self_attn.v_proj.weight"),
            (inf, "model.norm.weight"), (ints, "model.layers.0.input_layernorm.weight"),
            (unknown, "model.layers.0.mlp.upp_proj.weight"), (past, "model.layers.99.mlp.up_proj.weight")]


def test_a_bad_update_changes_nothing_and_names_the_parameter(engine, trained):
    before, logprobs, versions = greedy(engine)
    for weights, name in _bad_updates(trained):
        with pytest.raises(WeightsError) as exc:
            engine.update_weights(weights)
        assert exc.value.parameter == name and name in str(exc.value)
        assert greedy(engine) == (before, logprobs, versions)  # bit-identical, same version
    with pytest.raises(WeightsError, match="twice"):
        engine.update_weights([("model.norm.weight", torch.ones(64)), ("model.norm.weight", torch.ones(64))])
    with pytest.raises(WeightsError, match="no tensors"):
        engine.update_weights({})
    with pytest.raises(WeightsError, match="not a tensor"):
        engine.update_weights({"model.norm.weight": [1.0] * 64})
    with pytest.raises(WeightsError, match="no model folder"):
        engine.update_weights("/nonexistent/weights")
    assert greedy(engine) == (before, logprobs, versions)


@pytest.mark.parametrize("layout", [{"quantization": "int8"}, {"quantization": "bf16"}, {"gemv": "0"},
                                    {"dtype": "bfloat16"}])
def test_every_layout_serves_the_update_as_a_fresh_engine_would(tiny_dir, trained, tmp_path, monkeypatch, layout):
    """int8 (quantized again in place in the kernel's arena), bf16 weights, fp32 without the kernel (oneDNN packed
    weights, repacked), a bf16 model: the updated engine answers exactly as an engine started on the new weights."""
    from final.inf import InferenceEngine

    if "gemv" in layout:
        monkeypatch.setenv("FINAL_GEMV", layout["gemv"])
    local = {"quantization": layout["quantization"]} if "quantization" in layout else {}
    rollout = {"engine_kwargs": {"local": local}, **({"dtype": layout["dtype"]} if "dtype" in layout else {})}
    folder = save_policy(trained, tiny_dir, tmp_path / "m")
    with InferenceEngine(tiny_config(**rollout)) as eng:
        eng.update_weights(trained)
        updated = greedy(eng)
    with InferenceEngine({**tiny_config(**rollout), "model_path": folder}) as fresh:
        assert greedy(fresh)[:2] == updated[:2]


def test_calls_in_flight_finish_on_the_old_weights(tiny_dir, trained):
    """An update made while a call runs waits for it; the call's rows are the old model's, every one of them."""
    from final.inf import InferenceEngine

    with InferenceEngine(tiny_config(response_length=48)) as eng:
        old = eng.generate(PROMPTS * 4, temperature=0, max_tokens=48, ignore_eos=True).token_ids
        result: dict = {}
        call = threading.Thread(target=lambda: result.setdefault(
            "out", eng.generate(PROMPTS * 4, temperature=0, max_tokens=48, ignore_eos=True)))
        call.start()
        while eng._weights.versions.calls_in_flight == 0 and call.is_alive():
            time.sleep(0.001)
        assert eng.update_weights(trained) == 1  # returns once the call has finished
        call.join()
        assert result["out"].token_ids == old
        assert {m["weights_version"] for m in result["out"].metadata} == {0}
        assert greedy(eng)[0] == hf_greedy(trained, ids_of(eng), MAX)


@pytest.fixture
def own_engine(tiny_dir):
    """An embedded engine of its own (the session's tiny_engine must keep the original weights)."""
    from final.engine import EmbeddedEngine

    engine = EmbeddedEngine(tiny_dir)
    yield engine
    engine.shutdown()


def test_the_engine_itself_never_runs_a_row_on_two_sets_of_weights(own_engine, tiny_dir, trained):
    """EmbeddedEngine.update_weights (veRL's path through LocalRollout) waits for the rows already admitted; rows
    submitted meanwhile run on the new weights; each row's meta_info says which."""
    from final.weights import check_update, named_tensors

    tiny_engine = own_engine

    ids = [[1, 5, 6, 7], [1, 9, 10]]
    params = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    before = [o["output_ids"] for o in tiny_engine.submit_generate(ids, params).result()]
    running = tiny_engine.submit_generate(ids, params)
    named = check_update(named_tensors(trained), tiny_engine.parameter_shapes())
    version = tiny_engine.update_weights(named)
    later = tiny_engine.submit_generate(ids, params).result()
    outs = running.result()
    assert [o["output_ids"] for o in outs] == before
    assert {o["meta_info"]["weight_version"] for o in outs} == {version - 1}
    assert {o["meta_info"]["weight_version"] for o in later} == {version}
    assert [o["output_ids"][:MAX] for o in later] == hf_greedy(trained, ids, MAX)
    with pytest.raises(WeightsError):  # the engine thread's own check is the same rule
        tiny_engine.call(lambda _r: __import__("final.engine.weights", fromlist=["x"]).load_weights(
            tiny_engine.model, [("model.layers.7.mlp.up_proj.weight", torch.zeros(1))]))


def test_cartridges_made_for_old_weights_are_refused_unless_kept(tiny_dir, trained):
    from final.cartridges.build import build_from_text
    from final.inf import InferenceEngine

    with InferenceEngine(tiny_config()) as eng:
        cart = build_from_text(eng.engine, eng.tokenizer.encode("A short document about cartridges and weights."))
        eng.cartridges.add("doc", cart)
        with_cart = eng.generate("hi", cartridge="doc", temperature=0, max_tokens=4)
        eng.update_weights(trained, keep_cartridges=True)  # kept: served (stale) and marked so
        assert eng.generate("hi", cartridge="doc", temperature=0, max_tokens=4).completions
        assert eng.cartridges.store.get("doc").info["stale_since"] == 1
        eng.update_weights(trained)
        assert eng.cartridge_ids() == []
        with pytest.raises(CartridgeError, match="weights version") as exc:
            eng.generate("hi", cartridge="doc", temperature=0, max_tokens=4)
        assert exc.value.field == "weights_version" and exc.value.file == "doc"
        eng.cartridges.add("doc", build_from_text(eng.engine, eng.tokenizer.encode("A short document about it.")))
        again = eng.generate("hi", cartridge="doc", temperature=0, max_tokens=4)  # rebuilt for the new weights
        assert again.metadata[0]["weights_version"] == 2 and with_cart.metadata[0]["weights_version"] == 0


def test_release_frees_the_kv_pool_and_the_next_call_resumes(engine):
    before = greedy(engine)
    engine.release()
    assert engine.engine.call(lambda _r: engine.engine.cache.nbytes) == 0
    assert greedy(engine) == before  # resumed by itself
    engine.release()
    engine.resume(["weights"])
    engine.resume()
    assert greedy(engine) == before
    with pytest.raises(UnsupportedError, match="resume tags"):
        engine.resume(["optimizer"])


def test_an_update_from_inside_an_update_is_refused_not_a_deadlock():
    from final.versions import PolicyVersions

    gate = PolicyVersions()
    with gate.writing():
        with pytest.raises(EngineError, match="wait for itself"):
            with gate.reading():
                pass
    assert gate.version == 1
    with pytest.raises(RuntimeError):
        with gate.writing():
            raise RuntimeError("a refused update")
    assert gate.version == 1  # no bump without success


def test_a_backend_that_cannot_update_says_why(tiny_dir):
    from final.rollout.base import Capabilities
    from final.weight_sync import WeightSync

    class Fixed:
        capabilities = Capabilities(weight_updates=False, notes=(("update_weights", "train a cartridge"),))

    with pytest.raises(UnsupportedError, match="train a cartridge") as exc:
        WeightSync("fixed", Fixed(), lambda coro: None).update({"model.norm.weight": torch.ones(1)})
    assert exc.value.field == "update_weights"


@pytest.mark.slow
def test_smollm2_after_an_update_answers_as_hf_generate(smol_dir):
    """The real model, every 2-D weight perturbed, then one layer only: the engine's greedy tokens are HF's."""
    from final.inf import InferenceEngine

    with InferenceEngine({"model_path": "builtin:smollm2-135m-instruct", "progress": False,
                          "rollout": {"name": "local", "prompt_length": 128, "response_length": 16}}) as eng:
        policy = perturbed(smol_dir, scale=0.05, seed=4)
        eng.update_weights(policy)
        ids = ids_of(eng, ["What is the capital of France?", "Name a prime number."])
        assert eng.generate(["What is the capital of France?", "Name a prime number."], temperature=0,
                            max_tokens=16).token_ids == hf_greedy(policy, ids, 16, eos=2)
