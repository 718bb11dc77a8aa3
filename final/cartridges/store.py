"""CartridgeStore: which cartridges are resident, who is using them, and what to evict under a byte budget.

The store keeps bookkeeping only (the tensors live in the engine): per id its size, refcount and pin. Requests
take references for their duration; pinned or referenced cartridges are never evicted. When an admission would
exceed the budget, unpinned, unreferenced cartridges leave in least-recently-used order through `on_evict`
(the engine's `unload_cartridge`). All methods are thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from final.errors import CartridgeError


@dataclass
class StoreEntry:
    cartridge_id: str
    nbytes: int
    info: dict[str, Any] = field(default_factory=dict)  # source, path, manifest... for inspection
    refcount: int = 0
    pinned: bool = False


@dataclass
class StoreMetrics:
    hits: int = 0  # a request referenced a resident cartridge
    misses: int = 0  # a cartridge had to be fetched and loaded (or a request named an unknown id)
    loads: int = 0  # admissions (including reloads)
    evictions: int = 0
    bytes: int = 0
    count: int = 0


class CartridgeStore:
    def __init__(self, budget_bytes: int | None = None, on_evict: Callable[[str], Any] | None = None):
        self.budget_bytes = budget_bytes
        self.on_evict = on_evict
        self._entries: OrderedDict[str, StoreEntry] = OrderedDict()  # least recently used first
        self._lock = threading.RLock()
        self._metrics = StoreMetrics()

    # ---- admission -----------------------------------------------------------------------------------
    def put(self, cartridge_id: str, nbytes: int, *, pin: bool = False, info: dict | None = None) -> StoreEntry:
        """Admit (or replace) a cartridge, evicting LRU victims first; raises if the budget cannot be met."""
        with self._lock:
            old = self._entries.get(cartridge_id)
            held = self._bytes() - (old.nbytes if old else 0)
            if self.budget_bytes is not None:
                if nbytes > self.budget_bytes:
                    raise CartridgeError(f"needs {nbytes} bytes, more than the whole cartridge budget of "
                                         f"{self.budget_bytes}", file=cartridge_id, field="budget_bytes")
                victims = self._victims(held + nbytes - self.budget_bytes, exclude=cartridge_id)
                if victims is None:
                    raise CartridgeError(
                        f"needs {nbytes} bytes but only {self.budget_bytes - held} of the {self.budget_bytes}-byte "
                        "budget are free and the rest is pinned or in use", file=cartridge_id, field="budget_bytes")
                for victim in victims:
                    self._evict(victim)
            entry = StoreEntry(cartridge_id, nbytes, dict(info or {}), old.refcount if old else 0,
                               pin or (old.pinned if old else False))
            self._entries[cartridge_id] = entry
            self._entries.move_to_end(cartridge_id)
            self._metrics.loads += 1
            return entry

    def _victims(self, need: int, exclude: str) -> list[str] | None:
        victims, freed = [], 0
        for cid, e in self._entries.items():
            if freed >= need:
                break
            if cid != exclude and e.refcount == 0 and not e.pinned:
                victims.append(cid)
                freed += e.nbytes
        return victims if freed >= need else None

    def _evict(self, cartridge_id: str) -> None:
        self._entries.pop(cartridge_id)
        self._metrics.evictions += 1
        if self.on_evict is not None:
            self.on_evict(cartridge_id)

    def remove(self, cartridge_id: str) -> bool:
        """Forget a cartridge (explicit unload). Requests already holding it finish; their release is a no-op."""
        with self._lock:
            return self._entries.pop(cartridge_id, None) is not None

    # ---- use ---------------------------------------------------------------------------------------------
    def lookup(self, cartridge_id: str) -> StoreEntry | None:
        """Entry or None; a found entry becomes most recently used, a missing one counts as a miss."""
        with self._lock:
            entry = self._entries.get(cartridge_id)
            if entry is None:
                self._metrics.misses += 1
                return None
            self._entries.move_to_end(cartridge_id)
            return entry

    def acquire(self, ids: Iterable[str]) -> tuple[str, ...]:
        """Take one reference on each id (all or none); unknown ids raise CartridgeError."""
        ids = tuple(ids)
        with self._lock:
            missing = [i for i in ids if i not in self._entries]
            if missing:
                self._metrics.misses += len(missing)
                raise CartridgeError(f"unknown cartridge id(s) {missing}; loaded: {sorted(self._entries)}",
                                     file=missing[0], field="cartridges")
            for i in ids:
                self._entries[i].refcount += 1
                self._entries.move_to_end(i)
                self._metrics.hits += 1
        return ids

    def release(self, ids: Iterable[str]) -> None:
        with self._lock:
            for i in ids:
                entry = self._entries.get(i)
                if entry is not None and entry.refcount > 0:
                    entry.refcount -= 1

    def pin(self, cartridge_id: str, pinned: bool = True) -> None:
        with self._lock:
            entry = self._entries.get(cartridge_id)
            if entry is None:
                raise CartridgeError("is not loaded", file=cartridge_id, field="id")
            entry.pinned = pinned

    def unpin(self, cartridge_id: str) -> None:
        self.pin(cartridge_id, False)

    # ---- inspection ----------------------------------------------------------------------------------------
    def __contains__(self, cartridge_id: str) -> bool:
        with self._lock:
            return cartridge_id in self._entries

    def get(self, cartridge_id: str) -> StoreEntry | None:
        """Entry without touching metrics or LRU order."""
        with self._lock:
            return self._entries.get(cartridge_id)

    def ids(self) -> list[str]:
        """Resident ids, least recently used first."""
        with self._lock:
            return list(self._entries)

    def _bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def metrics(self) -> StoreMetrics:
        with self._lock:
            m = StoreMetrics(**vars(self._metrics))
            m.bytes, m.count = self._bytes(), len(self._entries)
            return m
