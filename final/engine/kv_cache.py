"""KV memory: each running row's own tokens in a dense slot cache, and cartridge prefixes held once.

Row i of the running batch lives in slot i, so the decode step reads `k[:B, :, :T]`, a view with no gather.
When a row leaves, the last row moves into its slot (one copy of one row, amortised). Capacity grows
geometrically in both rows and tokens and stays allocated (a static pool after warm-up) until `release()`.

Cartridge prefixes (`PrefixKV`) are not copied per row: every row that uses a cartridge points at the same
tensors, and a composition of several cartridges is concatenated once and shared by its rows. The prefix cache
(final/engine/prefix_cache.py) keeps cached token prefixes in the same layout, and copies between a row's slot
and its nodes go through `copy_out` / `copy_in`.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import torch

from final.errors import CartridgeError


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_tokens_per_row: int):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.max_tokens_per_row = max_tokens_per_row
        self.rows = 0  # slot capacity
        self.tokens = 0  # token capacity per slot
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._addresses: torch.Tensor | None = None  # addresses()'s table, until the tensors are replaced

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.tensor([], dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def _grown(self, rows: int, tokens: int) -> tuple[int, int]:
        r = self.rows if rows <= self.rows else max(rows, 2 * self.rows, 4)
        if tokens <= self.tokens:
            t = self.tokens
        else:
            t = max(tokens, 2 * self.tokens, 128)
            t = min(-(-t // 64) * 64, max(self.max_tokens_per_row, tokens))
        return r, t

    def clear_slot(self, slot: int) -> None:
        """Zero one slot's K/V (after a row that left NaN/inf in it, before another row moves in)."""
        if slot < self.rows:
            for k, v in zip(self.k, self.v):
                k[slot].zero_()
                v[slot].zero_()

    def reserve(self, rows: int, tokens: int) -> None:
        """Make room for `rows` slots of `tokens` tokens each, keeping the contents."""
        r, t = self._grown(rows, tokens)
        if (r, t) == (self.rows, self.tokens):
            return
        shape = (r, self.num_kv_heads, t, self.head_dim)
        new_k, new_v = [], []
        for i in range(self.num_layers):
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if self.k:
                k[: self.rows, :, : self.tokens] = self.k[i]
                v[: self.rows, :, : self.tokens] = self.v[i]
            new_k.append(k)
            new_v.append(v)
        self.k, self.v = new_k, new_v
        self.rows, self.tokens = r, t
        self._addresses = None

    def addresses(self) -> torch.Tensor:
        """[layers, 2] int64: each layer's K and V tensor address (the engine's C kernel writes and reads them)."""
        if self._addresses is None:
            self._addresses = torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in zip(self.k, self.v)],
                                           dtype=torch.int64)
        return self._addresses

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot `src`'s first `length` tokens into slot `dst` (compaction when a row leaves)."""
        for k, v in zip(self.k, self.v):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def copy_out(self, slot: int, a: int, b: int, dst: "PrefixKV", at: int) -> None:
        """Slot `slot`'s tokens [a, b) into dst's [at, at + b - a) (a finished row into the prefix cache)."""
        for mine, theirs in ((self.k, dst.k), (self.v, dst.v)):
            for src, out in zip(mine, theirs):
                out[:, at : at + b - a].copy_(src[slot, :, a:b])

    def copy_in(self, slot: int, segments: "tuple[PrefixKV, ...]") -> int:
        """The segments' tokens, in order, into slot `slot` from its first token (a cached prefix a row takes as
        its own where its decode cannot read segments); returns the tokens written."""
        at = 0
        for seg in segments:
            n = seg.length
            for mine, theirs in ((self.k, seg.k), (self.v, seg.v)):
                for dst, src in zip(mine, theirs):
                    dst[slot, :, at : at + n] = src
            at += n
        return at

    def release(self) -> None:
        self.k, self.v = [], []
        self.rows = self.tokens = 0
        self._addresses = None


_SERIALS = itertools.count(1)  # one per cartridge load: a reloaded id is another prefix to the cache


@dataclass(eq=False)
class PrefixKV:
    """A cartridge (or a composition of cartridges) as per-layer K/V of shape [Hkv, p, D], post-RoPE."""

    ids: tuple[str, ...]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    _addresses: torch.Tensor | None = field(default=None, repr=False)
    serials: tuple[int, ...] = ()  # the loads it is made of (a cartridge's own, or a composition's parts'): cache keys

    def addresses(self) -> torch.Tensor:
        """[layers, 2] int64: each layer's K and V tensor address (the engine's C kernel reads them)."""
        if self._addresses is None:
            self._addresses = torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in zip(self.k, self.v)],
                                           dtype=torch.int64)
        return self._addresses

    @property
    def length(self) -> int:
        return self.k[0].shape[1] if self.k else 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


@dataclass
class PrefixTable:
    """Loaded cartridges by id, plus shared concatenations for multi-cartridge requests."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    _single: dict[str, PrefixKV] = field(default_factory=dict)
    _composed: dict[tuple[str, ...], PrefixKV] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    version: int = 0  # counts loads and unloads (the engine thread drops the prefix cache's stale trees on a change)

    def add(self, cartridge_id: str, keys: list[torch.Tensor], values: list[torch.Tensor]) -> PrefixKV:
        k = [self._check(cartridge_id, "keys", i, t) for i, t in enumerate(keys)]
        v = [self._check(cartridge_id, "values", i, t) for i, t in enumerate(values)]
        if len(k) != self.num_layers or len(v) != self.num_layers:
            raise CartridgeError(f"has {len(k)} key and {len(v)} value layers, the model has {self.num_layers}",
                                 file=cartridge_id, field="keys/values")
        if any(a.shape != b.shape for a, b in zip(k, v)) or len({t.shape for t in k}) != 1:
            raise CartridgeError("K/V shapes differ across layers", file=cartridge_id, field="keys/values")
        prefix = PrefixKV((cartridge_id,), k, v, serials=(next(_SERIALS),))
        with self._lock:
            self.version += 1
            self._single[cartridge_id] = prefix
            self._composed = {ids: p for ids, p in self._composed.items() if cartridge_id not in ids}
        return prefix

    def _check(self, cid: str, name: str, layer: int, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise CartridgeError(f"layer {layer} is {type(t).__name__}, not a tensor", file=cid, field=name)
        if t.dim() == 4 and t.shape[0] == 1:
            t = t[0]
        want = (self.num_kv_heads, self.head_dim)
        if t.dim() != 3 or (t.shape[0], t.shape[2]) != want:
            raise CartridgeError(f"layer {layer} has shape {tuple(t.shape)}, expected [1, {want[0]}, T, {want[1]}]",
                                 file=cid, field=name)
        if t.shape[1] == 0:
            raise CartridgeError("has zero tokens", file=cid, field=name)
        return t.detach().to(device=self.device, dtype=self.dtype).contiguous()

    def remove(self, cartridge_id: str) -> bool:
        with self._lock:
            self.version += 1
            found = self._single.pop(cartridge_id, None) is not None
            self._composed = {ids: p for ids, p in self._composed.items() if cartridge_id not in ids}
        return found

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._single)

    def length_of(self, ids: tuple[str, ...]) -> int:
        """Tokens of the composition of `ids` (no tensor work: the request's own thread may ask)."""
        with self._lock:
            return sum(p.length for p in self._parts(ids))

    def _parts(self, ids: tuple[str, ...]) -> list[PrefixKV]:
        missing = [i for i in ids if i not in self._single]
        if missing:
            raise CartridgeError(f"unknown cartridge id(s) {missing}; loaded: {sorted(self._single)}",
                                 field="cartridges")
        return [self._single[i] for i in ids]

    def get(self, ids: tuple[str, ...]) -> PrefixKV | None:
        """The prefix for a request's cartridges in order (None for none); unknown ids raise CartridgeError."""
        if not ids:
            return None
        with self._lock:
            parts = self._parts(ids)
            if len(ids) == 1:
                return self._single[ids[0]]
            if ids not in self._composed:
                k = [torch.cat([p.k[layer] for p in parts], dim=1) for layer in range(self.num_layers)]
                v = [torch.cat([p.v[layer] for p in parts], dim=1) for layer in range(self.num_layers)]
                self._composed[ids] = PrefixKV(ids, k, v, serials=tuple(s for p in parts for s in p.serials))
            return self._composed[ids]

    def loaded(self, serials: tuple[int, ...]) -> bool:
        """Whether every load in `serials` is still the loaded cartridge of its id (a prefix-cache root's key)."""
        with self._lock:
            live = {p.serials[0] for p in self._single.values()}
        return all(s in live for s in serials)

    def prune_composed(self, in_use: set) -> None:
        """Drop concatenations no running row uses (they are rebuilt on demand)."""
        with self._lock:
            self._composed = {ids: p for ids, p in self._composed.items() if p in in_use}

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(p.nbytes for p in list(self._single.values()) + list(self._composed.values()))
