"""Real cartridges from every version of the HazyResearch cartridges repo, served exactly (issue 19).

Each cartridge here is built with HF transformers (position_ids given explicitly) and written as the repo writes
it: June 2025 files (`fixed_*`) trained with the tokens after the cache at p, later files (`frozen_*`) trained with
them at 0. HF's own logprobs under each convention are the reference; final's score/generate must give them."""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml

from compat_helpers import JUNE_CONFIG, LATER_CONFIG, hf_model, reference, save_repo_file, write_run
from conftest import tiny_config
from final.cartridges.format import load_cartridge
from final.cartridges.manifest import CartridgeManifest, read_manifest
from final.cartridges.positions import detect_positions, to_after_prefix
from final.cartridges.sources import fetch, sanitize_cartridge_id, wandb_run_id
from final.errors import CartridgeError


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.fixture(scope="module")
def inference():
    from final.inf import InferenceEngine

    with InferenceEngine(tiny_config(prompt_length=128, dtype="float32")) as engine:
        yield engine


def scored(inference, cid, cont):
    score = inference.score([cont], cartridge=cid)[0]
    return score.prompt_logprobs[1:]


def test_the_two_conventions_differ(ref):
    # otherwise nothing below could tell them apart
    diff = max(abs(a - b) for a, b in zip(ref["after_prefix"], ref["from_zero"]))
    assert diff > 1e-3


@pytest.mark.parametrize("layout,config,positions", [("june", JUNE_CONFIG, "after_prefix"),
                                                     ("later", LATER_CONFIG, "from_zero")])
def test_repo_runs_give_hf_logprobs(ref, inference, tmp_path, layout, config, positions):
    """A run folder (cache-stepN.pt, the cache_last.pt symlink, config.yaml): its convention read from the
    config, HF's logprobs through score() and the same greedy tokens through generate()."""
    last = write_run(tmp_path / layout, ref["keys"], ref["values"], layout=layout, config=config)
    cid = inference.load_cartridge(id=f"run-{layout}", path=str(last))
    assert inference.cartridges.store.get(cid).info["positions"] == positions
    got = scored(inference, cid, ref["cont"])
    assert got == pytest.approx(ref[positions], abs=2e-4)
    # the folder stands for its cache_last.pt too
    assert inference.load_cartridge(id=f"dir-{layout}", path=str(tmp_path / layout)) == f"dir-{layout}"
    assert scored(inference, f"dir-{layout}", ref["cont"]) == pytest.approx(got, abs=1e-6)


def test_option_and_manifest_set_the_convention(ref, inference, tmp_path):
    # no config.yaml: after_prefix unless the load option or the manifest says otherwise
    june = save_repo_file(ref["keys"], ref["values"], tmp_path / "bare" / "june.pt", layout="june")
    inference.load_cartridge(id="bare", path=str(june))
    assert scored(inference, "bare", ref["cont"]) == pytest.approx(ref["after_prefix"], abs=2e-4)
    inference.load_cartridge(id="opt", path=str(june), positions="from_zero")
    assert scored(inference, "opt", ref["cont"]) == pytest.approx(ref["from_zero"], abs=2e-4)
    later = save_repo_file(ref["keys"], ref["values"], tmp_path / "m" / "later.pt", layout="later")
    CartridgeManifest.describe(load_cartridge(later), later, cartridge_id="m", positions="from_zero").write(later)
    assert read_manifest(str(later) + ".manifest.json").positions == "from_zero"
    inference.load_cartridge(id="manifested", path=str(later))
    assert scored(inference, "manifested", ref["cont"]) == pytest.approx(ref["from_zero"], abs=2e-4)
    # a manifest that does not say (older ones): the run's config.yaml decides
    (later.parent / "config.yaml").write_text(yaml.safe_dump(LATER_CONFIG))
    CartridgeManifest.describe(load_cartridge(later), later, cartridge_id="m").write(later)
    data = json.loads((later.parent / "later.pt.manifest.json").read_text())
    del data["positions"]
    (later.parent / "later.pt.manifest.json").write_text(json.dumps(data))
    assert read_manifest(str(later) + ".manifest.json").positions is None
    inference.load_cartridge(id="old-manifest", path=str(later))
    assert inference.cartridges.store.get("old-manifest").info["positions"] == "from_zero"
    # the option wins over the manifest and the config
    inference.load_cartridge(id="forced", path=str(later), positions="after_prefix")
    assert scored(inference, "forced", ref["cont"]) == pytest.approx(ref["after_prefix"], abs=2e-4)


def test_generate_follows_the_convention(ref, inference, tmp_path):
    """Greedy decoding with a from_zero cartridge = HF decoding with the continuation from position 0."""
    from transformers import DynamicCache

    model, _ = hf_model()
    prompt = ref["cont"][:12]
    cache = DynamicCache()
    for i, (k, v) in enumerate(zip(ref["keys"], ref["values"])):
        cache.update(k.clone(), v.clone(), i)
    ids, expected = list(prompt), []
    with torch.no_grad():
        out = model(torch.tensor([ids]), past_key_values=cache, position_ids=torch.arange(len(ids))[None])
        for _ in range(8):
            nxt = int(out.logits[0, -1].argmax())
            expected.append(nxt)
            out = model(torch.tensor([[nxt]]), past_key_values=cache, position_ids=torch.tensor([[len(ids)]]))
            ids.append(nxt)
    path = write_run(tmp_path / "gen", ref["keys"], ref["values"], layout="later", config=LATER_CONFIG)
    inference.load_cartridge(id="gen", path=str(path))
    got = inference.generate([prompt], cartridge="gen", temperature=0, max_tokens=8, ignore_eos=True)
    assert got.token_ids[0] == expected


def test_rotation_keeps_dtype_and_values(ref):
    from final.cartridges.format import CartridgeKV
    from final.models import resolve_model_path

    cart = CartridgeKV([k.to(torch.bfloat16) for k in ref["keys"]], [v.to(torch.bfloat16) for v in ref["values"]], 1)
    out = to_after_prefix(cart, "from_zero", resolve_model_path("builtin:tiny-random-llama"), "x")
    assert out.dtype == torch.bfloat16 and out.values is cart.values
    assert not torch.equal(out.keys[0], cart.keys[0])
    # a rotation keeps every (head, token) key's norm
    assert torch.allclose(out.keys[0].float().norm(dim=-1), cart.keys[0].float().norm(dim=-1), rtol=1e-2)
    assert to_after_prefix(cart, "after_prefix", "unused", "x") is cart


def test_run_config_detection(tmp_path):
    def write(data):
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(data) if isinstance(data, dict) else data)
        return path

    assert detect_positions(write(JUNE_CONFIG)) == "after_prefix"
    assert detect_positions(write(LATER_CONFIG)) == "from_zero"
    assert detect_positions(write({"dataset": {"packed_seq_length": 4}})) == "from_zero"  # plain (not W&B) shape
    assert detect_positions(write({"positions": "from_zero", **JUNE_CONFIG})) == "from_zero"
    assert detect_positions(write({"lr": 0.02})) is None
    assert detect_positions(None) is None
    # the repo's configs can hold Python tags: read as plain data, never constructed
    assert detect_positions(write("dataset: !!python/object:cartridges.X\n  packed_seq_length: 8\n")) == "from_zero"
    assert detect_positions(write("dataset: !!python/tuple [1, 2]\n")) is None
    with pytest.raises(CartridgeError) as e:
        detect_positions(write({"positions": "sideways"}))
    assert "config.yaml" in e.value.field
    with pytest.raises(CartridgeError):
        detect_positions(write("a: [unclosed"))


def test_symlink_leaving_the_folder_is_refused_over_http(tmp_path):
    from final.server.prepare import _local_under, _under

    outside = tmp_path / "outside"
    inside = tmp_path / "served"
    write_run(outside, *_small(), layout="june", config=None)
    inside.mkdir()
    os.symlink(outside / "cache_last.pt", inside / "cache_last.pt")
    assert _under(inside.resolve(), "cache_last.pt") is None
    # a folder inside whose cache_last.pt leads out is refused too
    (inside / "linked").mkdir()
    os.symlink(outside / "cache_last.pt", inside / "linked" / "cache_last.pt")
    assert _local_under(inside.resolve(), "linked") is None
    write_run(inside / "run", *_small(), layout="june", config=None)
    assert _under(inside.resolve(), "run/cache_last.pt") == (inside / "run" / "cache-step64.pt").resolve()
    assert _local_under(inside.resolve(), "run") == (inside / "run" / "cache-step64.pt").resolve()


def _small():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(1, 2, 4, 16, generator=g) for _ in range(2)], [torch.randn(1, 2, 4, 16, generator=g)
                                                                         for _ in range(2)]


def test_tokasaurus_ids(tmp_path):
    # tokasaurus/utils.py sanitize_cartridge_id, geoff/cartridges
    assert sanitize_cartridge_id("hazy-research/cartridges/abc123") == "hazy-research-cartridges-abc123"
    assert sanitize_cartridge_id("../../etc/passwd") == "_etc-passwd"
    assert sanitize_cartridge_id("a:b|c") == "a_b_c"
    assert sanitize_cartridge_id("my.cart") == "my_cart"
    assert sanitize_cartridge_id("...").startswith("sanitized_")
    assert wandb_run_id("wauoq23f") == "hazy-research/cartridges/wauoq23f"
    assert wandb_run_id("me/proj/run1") == "me/proj/run1"
    # a local id: the folder ./cartridges/<sanitized id>/ with cartridge.pt and config.yaml
    folder = tmp_path / sanitize_cartridge_id("team/doc.v1")
    save_repo_file(*_small(), folder / "cartridge.pt", layout="later")
    (folder / "config.yaml").write_text(json.dumps(LATER_CONFIG))
    got = fetch("local", str(folder))
    assert got.path == folder / "cartridge.pt" and got.config == folder / "config.yaml"


def test_config_keys(tmp_path):
    from final.config import load_config
    from final.errors import ConfigError

    base = {"model_path": "builtin:tiny-random-llama"}
    assert load_config(base).cartridge_sources == ("local",)
    assert load_config({**base, "cartridge_sources": ["local", "hf", "wandb"]}).cartridge_sources == \
        ("local", "huggingface", "wandb")
    assert load_config({**base, "limits": {"cartridge_fetch_s": 5}}).limits.cartridge_fetch_s == 5
    for bad, key in (({"cartridge_sources": ["ftp"]}, "cartridge_sources"),
                     ({"limits": {"cartridge_fetch_s": 0}}, "limits.cartridge_fetch_s"),
                     ({"cartridges": [{"id": "a", "path": "a.pt", "positions": "sideways"}]}, "cartridges[0].positions")):
        with pytest.raises(ConfigError) as e:
            load_config({**base, **bad})
        assert e.value.key == key
