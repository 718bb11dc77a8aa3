"""Cartridge files: the cartridges repo's .pt layout (and older variants), .safetensors, manifests."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from cartridges_helpers import random_cart

from final.cartridges.format import load_cartridge, save_cartridge
from final.cartridges.manifest import (CartridgeManifest, ModelShape, check_matches_model, manifest_path,
                                       read_manifest, verify_checksum)
from final.errors import CartridgeError


def _same(a, b) -> None:
    assert a.num_frozen_tokens == b.num_frozen_tokens
    for x, y in zip(a.keys + a.values, b.keys + b.values):
        assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip(tmp_path, suffix, dtype):
    cart = random_cart(layers=3, tokens=7, frozen=1, dtype=dtype)
    path = save_cartridge(cart, tmp_path / f"c{suffix}")
    back = load_cartridge(path)
    _same(cart, back)
    assert (back.num_layers, back.num_kv_heads, back.num_tokens, back.head_dim) == (3, 2, 7, 16)


def test_pt_layout_is_the_cartridges_repo_layout(tmp_path):
    """What TrainableCache.save writes and from_pretrained reads (HazyResearch cartridges, cartridges/cache.py):
    trainable_keys/values and fixed_keys/values (from_pretrained raises KeyError without fixed_*), each an
    nn.ParameterList of [1, H, T, D] Parameters, frozen ones not requiring grad, frozen lists one per layer."""
    cart = random_cart(layers=2, tokens=5, frozen=1)
    path = save_cartridge(cart, tmp_path / "c.pt")
    ckpt = torch.load(path, weights_only=False)  # our own file, read as the cartridges repo does
    assert set(ckpt) == {"trainable_keys", "trainable_values", "fixed_keys", "fixed_values"}
    assert all(isinstance(v, nn.ParameterList) for v in ckpt.values())
    # from_pretrained's own checks
    assert len(ckpt["fixed_keys"]) == len(ckpt["trainable_keys"]) == 2
    assert ckpt["fixed_keys"][0].size(1) == ckpt["trainable_keys"][0].size(1)
    assert ckpt["fixed_keys"][0].size(3) == ckpt["trainable_keys"][0].size(3)
    assert ckpt["trainable_keys"][0].shape == (1, 2, 4, 16) and ckpt["fixed_keys"][0].shape == (1, 2, 1, 16)
    assert ckpt["trainable_keys"][0].requires_grad and not ckpt["fixed_keys"][0].requires_grad
    full = torch.cat([ckpt["fixed_keys"][1], ckpt["trainable_keys"][1]], dim=2)
    assert torch.equal(full, cart.keys[1])


def test_older_and_plain_variants(tmp_path):
    cart = random_cart(layers=2, tokens=6, frozen=2)
    parts = cart.split()
    # Older files say fixed_* for frozen; plain lists instead of ParameterLists.
    legacy = {"trainable_keys": parts["trainable_keys"], "trainable_values": parts["trainable_values"],
              "fixed_keys": parts["frozen_keys"], "fixed_values": parts["frozen_values"]}
    torch.save(legacy, tmp_path / "legacy.pt")
    _same(cart, load_cartridge(tmp_path / "legacy.pt"))
    # No frozen part at all (None, as TrainableCache leaves it, or missing).
    for frozen in (None, [], "missing"):
        obj = {"trainable_keys": cart.keys, "trainable_values": cart.values}
        if frozen != "missing":
            obj.update(frozen_keys=frozen, frozen_values=frozen)
        torch.save(obj, tmp_path / "nofrozen.pt")
        back = load_cartridge(tmp_path / "nofrozen.pt")
        assert back.num_frozen_tokens == 0 and torch.equal(back.keys[0], cart.keys[0])


def test_extension_does_not_decide_the_format(tmp_path):
    cart = random_cart()
    save_cartridge(cart, tmp_path / "c.safetensors").rename(tmp_path / "c.bin")
    _same(cart, load_cartridge(tmp_path / "c.bin"))


def test_manifest_round_trip_and_checksum(tmp_path):
    cart = random_cart(tokens=9)
    path = save_cartridge(cart, tmp_path / "c.pt")
    m = CartridgeManifest.describe(cart, path, cartridge_id="c", model_id="builtin:tiny-random-llama",
                                   source_document="doc.txt", labels={"topic": "test"})
    mpath = m.write(path)
    assert mpath == manifest_path(path) and mpath.name == "c.pt.manifest.json"
    data = json.loads(mpath.read_text())
    assert set(data) == {"cartridge_id", "model_id", "num_layers", "num_kv_heads", "head_dim", "dtype", "num_tokens",
                         "num_frozen_tokens", "sha256", "size", "created_at", "source_document", "labels", "positions"}
    back = read_manifest(mpath)
    assert back == m and back.num_tokens == 9 and back.dtype == "float32"
    verify_checksum(path, back)


def test_model_shape_from_spec_config_and_folder(tmp_path):
    from transformers import AutoConfig

    from final.engine.model import ModelSpec
    from final.models import resolve_model_path

    folder = resolve_model_path("builtin:tiny-random-llama")
    config = AutoConfig.from_pretrained(folder)
    shapes = {ModelShape.of(folder), ModelShape.of(config), ModelShape.of(ModelSpec.from_hf_config(config)),
              ModelShape.of(config.to_dict())}
    assert shapes == {ModelShape(2, 2, 16, 4096)}
    check_matches_model(random_cart(), ModelShape(2, 2, 16, 4096), "c")
    with pytest.raises(CartridgeError) as e:
        check_matches_model(random_cart(layers=3), ModelShape(2, 2, 16, 4096), "c")
    assert e.value.field == "num_layers"


def test_loads_on_many_threads_at_once(tmp_path):
    """final serve loads request cartridges on a thread pool: each load must keep ParameterList allow-listed
    while another thread's load ends (torch's safe_globals() context swapped a process-wide list; the soak saw
    'refused to unpickle' on a plain saved file)."""
    import concurrent.futures

    cart = random_cart()
    path = save_cartridge(cart, tmp_path / "c.pt")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        loaded = list(pool.map(lambda _: load_cartridge(path), range(64)))
    assert all(torch.equal(got.keys[0], cart.keys[0]) for got in loaded)


def test_loads_after_someone_elses_scoped_allow_list_ends(tmp_path):
    """A `with torch.serialization.safe_globals([nn.ParameterList])` block anywhere in the process (a test, a
    library) removes the class when it ends, even if it was allowed before; cartridges must still load after
    (a once-per-process flag refused every later cartridge in a clean-clone CI run: 33 failures)."""
    cart = random_cart()
    path = save_cartridge(cart, tmp_path / "c.pt")
    load_cartridge(path)
    with torch.serialization.safe_globals([nn.ParameterList]):
        torch.load(path, weights_only=True)
    assert nn.ParameterList not in torch.serialization.get_safe_globals()  # torch's behaviour this guards against
    assert torch.equal(load_cartridge(path).keys[0], cart.keys[0])
