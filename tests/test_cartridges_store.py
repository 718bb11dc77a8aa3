"""CartridgeStore (refcount, pin, LRU under a byte budget, metrics, threads) and its effect on a real engine."""

from __future__ import annotations

import threading

import pytest
from cartridges_helpers import greedy, open_engine, random_cart

from final.cartridges.format import save_cartridge
from final.cartridges.service import CartridgeService
from final.cartridges.store import CartridgeStore
from final.errors import CartridgeError


def test_lru_eviction_skips_pinned_and_referenced():
    evicted: list[str] = []
    store = CartridgeStore(budget_bytes=300, on_evict=evicted.append)
    for cid in "abc":
        store.put(cid, 100)
    store.pin("a")
    store.acquire(["b"])
    store.put("d", 100)  # a pinned, b in use: c (least recently used of the rest) goes
    assert evicted == ["c"] and store.ids() == ["a", "b", "d"]
    store.release(["b"])
    store.lookup("b")  # b becomes most recently used: d is now the LRU candidate
    store.put("e", 100)
    assert evicted == ["c", "d"]
    store.unpin("a")
    store.put("f", 200)  # needs two victims: a (LRU) then b
    assert evicted == ["c", "d", "a", "b"] and store.ids() == ["e", "f"]
    m = store.metrics()
    assert (m.evictions, m.loads, m.bytes, m.count) == (4, 6, 300, 2)


def test_budget_that_cannot_be_met_is_refused_atomically():
    evicted: list[str] = []
    store = CartridgeStore(budget_bytes=250, on_evict=evicted.append)
    store.put("a", 100, pin=True)
    store.put("b", 100)
    store.acquire(["b"])
    with pytest.raises(CartridgeError) as e:
        store.put("c", 100)
    assert (e.value.file, e.value.field) == ("c", "budget_bytes")
    with pytest.raises(CartridgeError):
        store.put("huge", 251)
    assert evicted == [] and store.ids() == ["a", "b"]


def test_refcounts_and_metrics():
    store = CartridgeStore()
    store.put("a", 10)
    store.acquire(["a", "a"])  # a request composing a cartridge with itself holds two references
    assert store.get("a").refcount == 2
    with pytest.raises(CartridgeError) as e:
        store.acquire(["a", "zz"])
    assert e.value.file == "zz" and store.get("a").refcount == 2
    store.release(["a", "a"])
    store.release(["a", "gone"])  # releasing more than held, or unknown ids, is harmless
    assert store.get("a").refcount == 0
    m = store.metrics()
    assert (m.hits, m.misses, m.loads, m.bytes) == (2, 1, 1, 10)


def test_thread_safety_under_contention():
    evicted: list[str] = []
    store = CartridgeStore(budget_bytes=1000, on_evict=evicted.append)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(200):
                cid = f"w{w}-{i % 7}"
                store.put(cid, 90)
                try:
                    held = store.acquire([cid])
                except CartridgeError:  # evicted by another thread in between: a legitimate miss
                    continue
                assert store.get(cid).refcount >= 1
                store.release(held)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    m = store.metrics()
    assert m.bytes <= 1000 and m.bytes == 90 * m.count
    assert all(store.get(c).refcount == 0 for c in store.ids())
    assert m.evictions == len(evicted) and m.loads == 8 * 200


def test_service_eviction_unloads_from_the_engine(tmp_path):
    engine, _tok = open_engine()
    try:
        size = random_cart().nbytes
        service = CartridgeService(engine, budget_bytes=2 * size)
        paths = [str(save_cartridge(random_cart(seed=i), tmp_path / f"c{i}.pt")) for i in range(4)]
        service.load(path=paths[0], pin=True)
        service.load(path=paths[1])
        assert set(engine.cartridge_ids()) == {paths[0], paths[1]}
        with service.using([paths[1]]):
            with pytest.raises(CartridgeError) as e:  # c0 pinned, c1 in use by a request: no room
                service.load(path=paths[2])
            assert e.value.field == "budget_bytes"
            assert paths[2] not in engine.cartridge_ids()
            assert greedy(engine, [5, 6, 7], 3, cartridges=(paths[1],))
        service.load(path=paths[2])  # c1 released: it is evicted, from the store and the engine
        assert set(engine.cartridge_ids()) == {paths[0], paths[2]} and set(service.ids()) == set(engine.cartridge_ids())
        assert service.load(path=paths[2]) == paths[2]  # resident: no reload
        m = service.metrics()
        assert (m.loads, m.evictions, m.bytes) == (3, 1, 2 * size)
        service.unpin(paths[0])
        service.load(path=paths[3])
        assert paths[0] not in engine.cartridge_ids()
        assert service.unload(paths[3]) and paths[3] not in engine.cartridge_ids()
        assert not service.unload(paths[3])
    finally:
        engine.shutdown()
