"""A request's `force_redownload: true` on a local cartridge (seed 000's on-policy loop sends it every request): the
newest file is served, an unchanged file is not read again, an explicit load() always reads. Real files, the
embedded engine on the tiny model; tests/test_verl_replica.py checks the same through `final serve`."""

from __future__ import annotations

import os
import shutil

import pytest

from final.cartridges.format import save_cartridge
from final.cartridges.manifest import MANIFEST_SUFFIX
from final.cartridges.service import CartridgeService
from final.errors import CartridgeError


@pytest.fixture
def service(tiny_engine):
    svc = CartridgeService(tiny_engine)
    yield svc
    for cid in svc.ids():
        svc.unload(cid)


def _cart(service, seed: int):
    import torch

    from final.cartridges.format import CartridgeKV

    g = torch.Generator().manual_seed(seed)
    m = service.model
    layers = [torch.randn(1, m.num_kv_heads, 4, m.head_dim, generator=g) for _ in range(2 * m.num_layers)]
    return CartridgeKV(layers[:m.num_layers], layers[m.num_layers:], num_frozen_tokens=1)


def test_force_redownload_reads_a_local_file_only_when_it_changed(service, tmp_path):
    a, b, training = tmp_path / "a.pt", tmp_path / "b.pt", tmp_path / "training.pt"
    save_cartridge(_cart(service, 0), a)
    save_cartridge(_cart(service, 1), b)
    shutil.copy(a, training)
    spec = [{"id": str(training), "source": "local", "force_redownload": True}]

    def loads() -> int:
        return service.metrics().loads

    service.ensure(spec)
    first = loads()
    service.ensure(spec)
    service.ensure(spec)
    assert loads() == first  # unchanged: not read again
    shutil.copy(b, training)  # same size, same inode: the new mtime/ctime tell
    service.ensure(spec)
    assert loads() == first + 1
    os.replace(a, training)  # written atomically (a new inode), as a trainer should
    service.ensure(spec)
    assert loads() == first + 2
    service.load(id=str(training), force_redownload=True)  # an explicit load always reads
    assert loads() == first + 3
    manifest = training.with_name(training.name + MANIFEST_SUFFIX)
    manifest.write_text("{not json")  # a manifest appearing beside the file counts as a change, and is checked
    with pytest.raises(CartridgeError):
        service.ensure(spec)
    manifest.unlink()
    training.unlink()  # gone: the resident copy is not served in its place
    with pytest.raises(CartridgeError, match="does not exist"):
        service.ensure(spec)
