"""Seed 004's fault tier: every bad cartridge input is a typed CartridgeError naming the file and the field, and
the engine keeps serving other requests (checked against a baseline after every case)."""

from __future__ import annotations

import asyncio
import os
import pickle

import pytest
import torch
from cartridges_helpers import greedy, open_engine, random_cart

from final.cartridges.build import build_from_text, continuation_ids, document_ids
from final.cartridges.format import save_cartridge
from final.cartridges.manifest import CartridgeManifest, manifest_path
from final.cartridges.service import CartridgeService
from final.errors import CartridgeError

MAX_LEN = 96


@pytest.fixture(scope="module")
def served():
    engine, tok = open_engine(max_model_len=MAX_LEN)
    service = CartridgeService(engine)
    good = build_from_text(engine, document_ids(tok, "The key is under the blue pot."))
    service.add("good", good)
    q = continuation_ids(tok, "Where is the key?")
    baseline = greedy(engine, q, cartridges=("good",))
    plain = greedy(engine, q)
    yield engine, service, q, baseline, plain
    engine.shutdown()


@pytest.fixture()
def service(served):
    """The shared service; after each case a good request must still give the baseline answer."""
    engine, svc, q, baseline, plain = served
    yield svc
    assert greedy(engine, q, cartridges=("good",)) == baseline
    assert greedy(engine, q) == plain


def _expect(service, path, field, **kwargs) -> CartridgeError:
    with pytest.raises(CartridgeError) as e:
        service.load(path=str(path), **kwargs)
    assert e.value.field == field, e.value
    assert e.value.file and str(path) in e.value.file, e.value
    assert str(path) in str(e.value) and field in str(e.value)
    assert str(path) not in service.ids()
    return e.value


def _save_dict(path, obj):
    torch.save(obj, path)
    return path


def test_missing_file(service, tmp_path):
    _expect(service, tmp_path / "nope.pt", "path")


def test_empty_file(service, tmp_path):
    (tmp_path / "empty.pt").write_bytes(b"")
    _expect(service, tmp_path / "empty.pt", "file")


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_truncated_file(service, tmp_path, suffix):
    path = save_cartridge(random_cart(), tmp_path / f"c{suffix}")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _expect(service, path, "file")


def test_random_bytes(service, tmp_path):
    (tmp_path / "noise.pt").write_bytes(os.urandom(4096))
    _expect(service, tmp_path / "noise.pt", "file")


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("writer", ["torch.save", "pickle2", "pickle4"])
def test_pickle_that_would_run_code_is_refused_and_does_not_run(service, tmp_path, writer):
    marker = tmp_path / "pwned"
    obj = {"trainable_keys": _RunsCode(str(marker)), "trainable_values": []}
    pickle.loads(pickle.dumps(obj))  # the payload is live: an unsafe load runs it
    assert marker.exists()
    marker.unlink()
    path = tmp_path / "evil.pt"
    if writer == "torch.save":
        torch.save(obj, path)
    else:
        path.write_bytes(pickle.dumps(obj, protocol=int(writer[-1])))
    err = _expect(service, path, "pickle")
    if writer != "pickle4":  # protocol 4 is refused at its first FRAME opcode, before the global is named
        assert "system" in str(err)
    assert not marker.exists()


def test_missing_keys(service, tmp_path):
    cart = random_cart()
    _expect(service, _save_dict(tmp_path / "c.pt", {"trainable_keys": cart.keys}), "trainable_values")
    _expect(service, _save_dict(tmp_path / "c2.pt", {"keys": cart.keys}), "trainable_keys")
    _expect(service, _save_dict(tmp_path / "c3.pt", {"trainable_keys": cart.keys, "trainable_values": cart.values,
                                                    "frozen_keys": cart.keys}), "frozen_values")
    _expect(service, _save_dict(tmp_path / "c4.pt", cart.keys), "file")  # not a dict at all


def test_kv_layer_count_mismatch(service, tmp_path):
    cart = random_cart()
    path = _save_dict(tmp_path / "c.pt", {"trainable_keys": cart.keys, "trainable_values": cart.values[:1]})
    _expect(service, path, "trainable_values")


def test_shape_mismatch_across_layers(service, tmp_path):
    cart = random_cart()
    keys = [cart.keys[0], cart.keys[1][:, :, :5]]
    _expect(service, _save_dict(tmp_path / "c.pt", {"trainable_keys": keys, "trainable_values": cart.values}),
            "trainable_keys[1]")
    values = [cart.values[0], cart.values[1][:, :1]]
    _expect(service, _save_dict(tmp_path / "c2.pt", {"trainable_keys": cart.keys, "trainable_values": values}),
            "trainable_values[1]")
    _expect(service, _save_dict(tmp_path / "c3.pt", {"trainable_keys": [k[0] for k in cart.keys],
                                                    "trainable_values": cart.values}), "trainable_keys[0]")


@pytest.mark.parametrize("field,kwargs", [("num_layers", {"layers": 3}), ("num_kv_heads", {"heads": 4}),
                                          ("head_dim", {"dim": 8})])
def test_model_mismatch(service, tmp_path, field, kwargs):
    _expect(service, save_cartridge(random_cart(**kwargs), tmp_path / "c.pt"), field)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_rejected_unless_allowed(service, tmp_path, bad):
    cart = random_cart()
    cart.values[1][0, 0, 3, 2] = bad
    path = save_cartridge(cart, tmp_path / "c.pt")
    _expect(service, path, "trainable_values[1]")
    assert service.load(path=str(path), allow_nonfinite=True) == str(path)
    service.unload(str(path))


def test_zero_tokens(service, tmp_path):
    cart = random_cart(tokens=0, frozen=0)
    _expect(service, _save_dict(tmp_path / "c.pt", {"trainable_keys": cart.keys, "trainable_values": cart.values}),
            "num_tokens")


def test_checksum_mismatch(service, tmp_path):
    cart = random_cart()
    path = save_cartridge(cart, tmp_path / "c.safetensors")
    CartridgeManifest.describe(cart, path, cartridge_id="c").write(path)
    assert service.load(path=str(path)) == str(path)
    service.unload(str(path))
    cart.keys[0][0, 0, 0, 0] += 1.0  # same size, different bytes
    save_cartridge(cart, path)
    _expect(service, path, "sha256")
    path.write_bytes(path.read_bytes() + b"\0")
    _expect(service, path, "size")


def test_manifest_disagrees_with_file(service, tmp_path):
    cart = random_cart(tokens=8)
    path = save_cartridge(cart, tmp_path / "c.pt")
    m = CartridgeManifest.describe(cart, path, cartridge_id="c")
    m.num_tokens = 9
    m.write(path)
    _expect(service, path, "num_tokens")
    manifest_path(path).write_text("{not json")
    with pytest.raises(CartridgeError) as e:
        service.load(path=str(path))
    assert e.value.field == "manifest" and e.value.file == str(manifest_path(path))


def test_unknown_id_in_a_request(service, served):
    engine = served[0]
    with pytest.raises(CartridgeError) as e:
        with service.using(["good", "nope"]):
            pass
    assert (e.value.file, e.value.field) == ("nope", "cartridges[1]")  # names the request's entry
    assert service.store.get("good").refcount == 0  # all or nothing
    with pytest.raises(CartridgeError) as e:
        engine.generate([1, 2, 3], {"max_new_tokens": 2}, cartridges=("nope",))
    assert e.value.field == "cartridges" and "nope" in str(e.value)
    with pytest.raises(CartridgeError) as e:
        service.ensure(["nope"])
    assert e.value.file == "nope"


def test_unknown_source_and_bad_spec(service):
    with pytest.raises(CartridgeError) as e:
        service.ensure([{"id": "x", "source": "ftp"}])
    assert e.value.field == "cartridges[0].source"
    with pytest.raises(CartridgeError) as e:
        service.ensure([{"id": "x", "sauce": "local"}])
    assert e.value.field == "cartridges[0].sauce"
    with pytest.raises(CartridgeError) as e:
        service.ensure([{"id": "x", "force_redownload": "yes"}])
    assert e.value.field == "cartridges[0].force_redownload"


def test_cartridge_plus_prompt_over_the_context_limit(service, served, tmp_path):
    engine = served[0]
    service.add("long", random_cart(tokens=MAX_LEN - 10))
    try:
        with pytest.raises(CartridgeError) as e:
            engine.generate(list(range(5, 20)), {"max_new_tokens": 2}, cartridges=("long",))
        assert (e.value.file, e.value.field) == ("long", "max_model_len")
        assert len(engine.generate(list(range(5, 8)), {"max_new_tokens": 2}, cartridges=("long",))["output_ids"]) > 0
    finally:
        service.unload("long")
    # A cartridge that alone fills the context is refused at load time.
    _expect(service, save_cartridge(random_cart(tokens=MAX_LEN), tmp_path / "huge.pt"), "num_tokens")


def test_bad_request_does_not_disturb_concurrent_requests(served):
    engine, service, q, baseline, _ = served

    async def both():
        good = engine.async_generate(input_ids=q, sampling_params={"max_new_tokens": 12, "temperature": 0.0},
                                     cartridges=("good",))
        bad = engine.async_generate(input_ids=q, sampling_params={"max_new_tokens": 12}, cartridges=("nope",))
        return await asyncio.gather(good, bad, return_exceptions=True)

    out, err = asyncio.run(both())
    assert isinstance(err, CartridgeError)
    assert out["output_ids"] == baseline


def test_engine_checks_remain_the_last_line(served):
    engine = served[0]
    cart = random_cart(heads=3)
    with pytest.raises(CartridgeError) as e:
        engine.load_cartridge("direct", cart.keys, cart.values)
    assert e.value.file == "direct"
    with pytest.raises(CartridgeError):
        engine.load_cartridge("direct", [torch.zeros(2, 0, 16)] * 2, [torch.zeros(2, 0, 16)] * 2)
    assert "direct" not in engine.cartridge_ids()
