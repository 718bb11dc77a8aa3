"""LoRA adapters from disk served per row on the embedded engine (final/engine/lora.py): a PEFT folder written by
peft serves what HF + PEFT's PeftModel generates (greedy tokens, log-probs within 1e-4, fp32), rows of different
adapters (and of none) in one batch each get their own adapter's answer, a bad adapter is refused naming the
tensor or config key, and unloading leaves the base as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from final.errors import AdapterError, UnsupportedError, WeightsError
from lora_helpers import ADAPTERS, hf_rows, load_peft, write_adapter

PROMPTS = ["hello there", "What is 2+2?", "abc def ghi"]
MAX = 10
ATOL = 1e-4
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folders(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_adapter(tiny_dir, root / name, seed, **cfg)
            for seed, (name, cfg) in enumerate(ADAPTERS.items(), 1)}


@pytest.fixture(scope="module")
def engine(folders):
    from final.inf import InferenceEngine

    with InferenceEngine(tiny_config()) as eng:
        for name, folder in folders.items():
            assert eng.load_adapter(folder) == name  # the folder's name
        yield eng


def rows(engine, prompts=PROMPTS, **kw):
    out = engine.generate(prompts, temperature=0, max_tokens=MAX, logprobs=True, **kw)
    return [(ids, m["logprobs"]) for ids, m in zip(out.token_ids, out.metadata)]


def assert_rows_equal(got, want, atol=ATOL):
    for (ids, lps), (ref_ids, ref_lps) in zip(got, want, strict=True):
        assert ids == ref_ids
        assert lps == pytest.approx(ref_lps, abs=atol)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_an_adapter_from_disk_serves_what_hf_and_peft_generate(engine, folders, tiny_dir, name):
    want = hf_rows(load_peft(tiny_dir, folders[name]), engine.prepare(PROMPTS).ids, MAX, engine.eos_token_ids[0])
    got = rows(engine, adapter=name)
    assert_rows_equal(got, want)
    assert [ids for ids, _ in got] != [ids for ids, _ in rows(engine)]  # the adapter changed the answers


def test_rows_of_different_adapters_in_one_batch_get_their_own_adapters_answer(engine):
    plan = ["all", None, "qvd", "mlp", "all", None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(plan))]
    mixed = rows(engine, prompts, adapter=plan)
    for prompt, name, row in zip(prompts, plan, mixed):
        alone = rows(engine, [prompt], adapter=name)[0] if name else rows(engine, [prompt])[0]
        assert_rows_equal([row], [alone])


def test_n_samples_and_streams_keep_their_adapter(engine):
    sampled = engine.generate(PROMPTS[0], adapter="qvd", n=3, temperature=1.0, seed=7, max_tokens=MAX)
    again = engine.generate([PROMPTS[0]] * 3, adapter="qvd", temperature=1.0, seed=7, max_tokens=MAX)
    assert sampled.token_ids[0] == again.token_ids[0]  # row 0 of both calls: seed 7, the same adapter
    request = engine.prepare([PROMPTS[1]], adapter="mlp", temperature=0, max_tokens=MAX)

    async def stream():
        last = None
        async for row in engine.astream(request):
            last = row
        return last.output_ids

    import asyncio

    assert asyncio.run(stream()) == rows(engine, [PROMPTS[1]], adapter="mlp")[0][0]


def test_unknown_adapters_and_bad_lists_are_typed_errors(engine):
    with pytest.raises(AdapterError) as err:
        engine.generate("hi", adapter="nope")
    assert err.value.field == "adapter" and "nope" in str(err.value) and "all" in str(err.value)
    with pytest.raises(AdapterError, match="one per prompt"):
        engine.generate(["a", "b"], adapter=["all"])
    with pytest.raises(AdapterError, match="control character"):
        engine.generate("hi", adapter="a\x00b")
    assert rows(engine, ["hi"])  # the engine keeps serving


def test_unloading_an_adapter_leaves_the_base_exactly(folders, tiny_dir, tmp_path):
    from final.inf import InferenceEngine

    with InferenceEngine(tiny_config()) as eng:
        names = sorted(eng.engine.parameter_shapes())
        weights = eng.engine.current_weights(names)
        base = rows(eng)
        eng.load_adapter(folders["all"], name="x")
        assert rows(eng, adapter="x") != base
        assert eng.unload_adapter("x") and not eng.unload_adapter("x")
        assert eng.adapter_names() == []
        with pytest.raises(AdapterError):
            eng.generate("hi", adapter="x")
        assert rows(eng) == base
        after = eng.engine.current_weights(names)
        assert all(torch.equal(weights[n], after[n]) for n in names)


def test_a_name_loaded_again_serves_the_new_adapter(folders, tiny_dir):
    from final.inf import InferenceEngine

    with InferenceEngine(tiny_config()) as eng:
        eng.load_adapter(folders["all"], name="x")
        first = rows(eng, adapter="x")
        eng.load_adapter(folders["mlp"], name="x")
        want = hf_rows(load_peft(tiny_dir, folders["mlp"]), eng.prepare(PROMPTS).ids, MAX, eng.eos_token_ids[0])
        assert rows(eng, adapter="x") != first
        assert_rows_equal(rows(eng, adapter="x"), want)


def _edited_copy(folder, dest, edit=None, config=None):
    """A copy of a real PEFT adapter folder with one tensor or config key changed (what a mismatched or corrupt
    adapter looks like)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    if edit is not None:
        tensors = load_file(f"{dest}/adapter_model.safetensors")
        edit(tensors)
        save_file(tensors, f"{dest}/adapter_model.safetensors")
    if config is not None:
        cfg = json.loads((dest / "adapter_config.json").read_text())
        cfg.update(config)
        (dest / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dest)


A = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize("edit, config, error, names", [
    (lambda t: t.__setitem__(A, t[A][:, :-1].contiguous()), None, WeightsError, A),
    (lambda t: t.__setitem__(B, t[B][:, :2].contiguous()), None, WeightsError, B),
    (lambda t: t.__setitem__(A.replace("layers.1", "layers.7"), t[A].clone()), None, WeightsError, "layers.7"),
    (lambda t: t.__setitem__("base_model.model.model.norm.lora_A.weight", t[A].clone()), None, WeightsError,
     "model.norm"),
    (lambda t: t.pop(B), None, WeightsError, "lora_B"),
    (lambda t: t[A].__setitem__((0, 0), float("nan")), None, WeightsError, "NaN"),
    (None, {"r": 8}, WeightsError, "r=8"),
    (None, {"use_dora": True}, AdapterError, "use_dora"),
    (None, {"modules_to_save": ["lm_head"]}, AdapterError, "modules_to_save"),
    (None, {"bias": "all"}, AdapterError, "bias"),
], ids=["A-shape", "B-rank", "unknown-layer", "not-a-projection", "lone-A", "nan", "config-rank", "dora",
        "modules-to-save", "bias"])
def test_a_bad_adapter_is_refused_naming_the_tensor_or_key(engine, folders, tmp_path, edit, config, error, names):
    bad = _edited_copy(folders["all"], tmp_path / "bad", edit, config)
    before = rows(engine, adapter="all")
    with pytest.raises(error, match=names.replace(".", r"\.").replace("[", r"\[")):
        engine.load_adapter(bad, name="bad")
    assert "bad" not in engine.adapter_names()
    assert rows(engine, adapter="all") == before


def test_a_folder_without_an_adapter_is_refused(engine, tmp_path, tiny_dir):
    with pytest.raises(AdapterError, match="adapter_config.json"):
        engine.load_adapter(tiny_dir)  # a model folder, not an adapter
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "peft_type": "LORA"}))
    with pytest.raises(AdapterError, match="adapter_model"):
        engine.load_adapter(tmp_path)


def test_multi_turn_calls_refuse_per_request_adapters(tiny_dir, tmp_path):
    from final.inf import InferenceEngine
    from multiturn_helpers import make_tool_model

    tool_dir = make_tool_model(tiny_dir, tmp_path / "m")

    config = {"model_path": tool_dir, "progress": False,
              "rollout": {"name": "local", "prompt_length": 512, "response_length": 16,
                          "multi_turn": {"enable": True, "tool_config_path": str(ROOT / "tools.yaml")}}}
    with InferenceEngine(config) as eng:
        with pytest.raises(UnsupportedError, match="multi-turn") as err:
            eng.generate("What is 2+2?", adapter="any")
        assert err.value.field == "adapter"


@pytest.mark.slow
def test_a_smollm2_adapter_serves_what_hf_and_peft_generate_per_row_and_merged(smol_dir, tmp_path):
    """SmolLM2-135M (30 layers, GQA 9/3 heads, tied embeddings) with an all-linear r=16 adapter of a trained size:
    per row from disk, then merged by update_weights, each against PeftModel."""
    from final.inf import InferenceEngine

    folder = write_adapter(smol_dir, tmp_path / "smol", 21, b_scale=0.05, r=16, lora_alpha=32,
                           target_modules="all-linear")
    config = {"model_path": "builtin:smollm2-135m-instruct", "progress": False,
              "rollout": {"name": "local", "prompt_length": 128, "response_length": 16}}
    with InferenceEngine(config) as eng:
        want = hf_rows(load_peft(smol_dir, folder), eng.prepare(PROMPTS).ids, MAX, eng.eos_token_ids[0])
        base = rows(eng)
        eng.load_adapter(folder)
        assert_rows_equal(rows(eng, adapter="smol"), want)
        eng.update_weights(folder)
        assert_rows_equal(rows(eng), want)
        assert rows(eng) != base
