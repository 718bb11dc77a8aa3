"""PrefixCache: the K/V of prompts and finished rows, kept so a later row prefills only what is new.

SGLang's RadixCache (mem_cache/radix_cache.py) on this engine's memory: a radix tree keyed by token ids, one tree
per cartridge composition in front (its root key, Sequence.cache_key: the loaded cartridges' serials, so the
positions and the K/V they give every later token are part of the key; the weights, dtype, quantization and layout
are the engine's own, one cache per engine, emptied by every weight update). A node holds its edge's tokens and their post-RoPE K/V as one
contiguous allocation, [Hkv, n, D] a layer (a PrefixKV, the cartridges' own layout), so a row attached to a path
of nodes attends to them where they lie: the engine's kernel reads a row's prefix as segments (a cartridge, then
these nodes) in one softmax. Nothing is copied per row. Why not vLLM's fixed blocks: the attention here reads
contiguous [n, D] runs per head, so a node of any length is one run, and a block table per row would cost the
decode step a gather per layer.

- Granularity: one token (SGLang's page size 1): a hit may end anywhere, though one under MIN_HIT tokens is not
  used (it saves less prefill than another segment's attention pass costs). Where a prompt leaves an edge midway
  the node is split in two, each half copied into its own allocation (a node's bytes are its own, and evicting it
  frees them), so a hit never straddles a node. A finished row extends its own leaf when nothing else uses it
  instead of hanging a child under it, so a conversation stays one node deep however many turns it has. Where
  the attention cannot read segments (bf16, CUDA) a row copies its hit into its own slot instead.
- What is cached: each finished row's prompt + output (all but the newest token, whose K/V does not exist), so the
  next turn of a conversation hits; the n samples of one prompt share one prefill (final/engine/runner.py).
- Locks: a running row holds its path (lock counts up to the root, as SGLang's lock_ref); only unlocked leaves are
  evicted, least recently used first, when an insert would pass `max_bytes` or the scheduler needs room for rows.
- Generations: `clear()` (flush_cache, a weight update, release) starts a new generation; rows admitted before
  it neither unlock into nor insert into the new tree.
Everything here runs on the engine thread.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from final.engine.kv_cache import PrefixKV

MIN_HIT = 16  # tokens
Fill = Callable[[PrefixKV, int, int, int], None]  # fill(node_kv, at, a, b): tokens [a, b) into node_kv from `at`


@dataclass(eq=False)
class Node:
    key: list[int]  # the edge's tokens
    kv: PrefixKV | None  # their K/V, [Hkv, len(key), D] a layer; None at a root
    parent: "Node | None"
    children: dict[int, "Node"] = field(default_factory=dict)  # by first token
    lock: int = 0  # running rows whose path passes through here
    used: float = field(default_factory=time.monotonic)

    def __lt__(self, other: "Node") -> bool:  # heapq: least recently used first
        return self.used < other.used


@dataclass(frozen=True, eq=False)
class Hit:
    """A row's cached prefix: the path of nodes it attends to (their K/V taken when it matched), their tokens."""

    nodes: tuple[Node, ...]
    segments: tuple[PrefixKV, ...]
    length: int
    generation: int


@dataclass
class CacheStats:
    hits: int = 0  # rows that attached to a cached prefix
    hit_tokens: int = 0
    inserted_tokens: int = 0
    evicted_tokens: int = 0
    flushes: int = 0


def common_length(key: list[int], ids: list[int], start: int, stop: int) -> int:
    """How many of key's tokens equal ids[start:stop] from the front (slices compare in C, 64 at a time)."""
    n, i = min(len(key), stop - start), 0
    while i < n:
        j = min(i + 64, n)
        if key[i:j] != ids[start + i:start + j]:
            return i + next(t for t in range(j - i) if key[i + t] != ids[start + i + t])
        i = j
    return n


class PrefixCache:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 max_bytes: int):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.max_bytes = max_bytes
        self.bytes_per_token = 2 * layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
        self.roots: dict[tuple, Node] = {}
        self.nbytes = 0
        self.generation = 0
        self.stats = CacheStats()

    # ---- storage ---------------------------------------------------------------------------------------
    def new_kv(self, tokens: int) -> PrefixKV:
        """One allocation for `tokens` tokens of every layer's K and V, as [Hkv, tokens, D] views."""
        buf = torch.empty(2, self.layers, self.kv_heads, tokens, self.head_dim, dtype=self.dtype, device=self.device)
        return PrefixKV((), [buf[0, i] for i in range(self.layers)], [buf[1, i] for i in range(self.layers)])

    def _slice(self, kv: PrefixKV, a: int, b: int) -> PrefixKV:
        out = self.new_kv(b - a)
        for dst, src in zip(out.k + out.v, kv.k + kv.v):
            dst.copy_(src[:, a:b])
        return out

    # ---- lookup ----------------------------------------------------------------------------------------
    def match(self, root_key: tuple, ids: list[int], limit: int, minimum: int = 1) -> Hit | None:
        """The longest cached prefix of ids[:limit] under root_key (None for none, or one shorter than `minimum`).
        A hit that ends inside a node splits it there, so the returned path ends on a node boundary."""
        node = self.roots.get(root_key)
        path: list[Node] = []
        i, now = 0, time.monotonic()
        while node is not None and i < limit:
            child = node.children.get(ids[i])
            if child is None:
                break
            n = common_length(child.key, ids, i, limit)
            if n < len(child.key):
                if i + n < minimum:  # no split for a hit that will not be used
                    break
                child = self._split(child, n)
            child.used = now
            path.append(child)
            i += n
            node = child
        if not path or i < minimum:
            return None
        return Hit(tuple(path), tuple(n.kv for n in path), i, self.generation)

    def _split(self, node: Node, n: int) -> Node:
        """node's first n tokens become a new parent of the rest (SGLang's _split_node, with each part's K/V copied
        into its own allocation). A running row keeps the tensors it took when it matched."""
        top = Node(node.key[:n], self._slice(node.kv, 0, n), node.parent, lock=node.lock, used=node.used)
        rest = self._slice(node.kv, n, len(node.key))
        node.parent.children[node.key[0]] = top
        node.key, node.kv, node.parent = node.key[n:], rest, top
        top.children[node.key[0]] = node
        return top

    # ---- locks -----------------------------------------------------------------------------------------
    def lock(self, hit: Hit) -> None:
        self._walk(hit.nodes[-1], +1)

    def unlock(self, hit: Hit) -> None:
        if hit.generation == self.generation:
            self._walk(hit.nodes[-1], -1)

    @staticmethod
    def _walk(node: Node | None, delta: int) -> None:
        while node is not None and node.kv is not None:
            node.lock += delta
            node = node.parent

    # ---- insert ----------------------------------------------------------------------------------------
    def insert(self, root_key: tuple, ids: list[int], fill: Fill, have_from: int) -> int:
        """Cache ids' K/V under root_key. The tree's existing prefix of ids is kept; `fill` supplies the rest, which
        the caller holds from token `have_from` on. Returns the tokens added (0 where they would pass max_bytes
        even after eviction, or the tree lacks tokens before have_from)."""
        node = self.roots.setdefault(root_key, Node([], None, None))
        i, now = 0, time.monotonic()
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                break
            n = common_length(child.key, ids, i, len(ids))
            if i + n == len(ids):  # all of ids is cached already (no split for a prefix of an edge)
                child.used = now
                return 0
            node = child if n == len(child.key) else self._split(child, n)
            node.used = now
            i += n
        new = len(ids) - i
        if new == 0 or i < have_from:
            return 0
        extend = node.kv is not None and not node.children and node.lock == 0
        self._walk(node, +1)  # the path stays while room is made
        over = self.nbytes + new * self.bytes_per_token - self.max_bytes
        if over > 0:
            self.evict(over)
        self._walk(node, -1)
        if self.nbytes + new * self.bytes_per_token > self.max_bytes:
            return 0
        if extend:  # the leaf grows: a conversation stays one node however many turns it has
            kv = self.new_kv(len(node.key) + new)
            for dst, src in zip(kv.k + kv.v, node.kv.k + node.kv.v):
                dst[:, : len(node.key)].copy_(src)
            fill(kv, len(node.key), i, len(ids))
            node.key, node.kv = node.key + ids[i:], kv
        else:
            kv = self.new_kv(new)
            fill(kv, 0, i, len(ids))
            node.children[ids[i]] = Node(ids[i:], kv, node, used=now)
        self.nbytes += new * self.bytes_per_token
        self.stats.inserted_tokens += new
        return new

    # ---- eviction --------------------------------------------------------------------------------------
    def evict(self, nbytes: int) -> int:
        """Free at least nbytes (if that many are unlocked) by dropping unlocked leaves, least recently used first;
        returns the bytes freed."""
        leaves = [n for n in self._nodes() if not n.children and n.lock == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < nbytes and leaves:
            node = heapq.heappop(leaves)
            freed += self._drop(node)
            parent = node.parent
            if parent.kv is not None and not parent.children and parent.lock == 0:
                heapq.heappush(leaves, parent)
        return freed

    def _drop(self, node: Node) -> int:
        del node.parent.children[node.key[0]]
        gone = len(node.key) * self.bytes_per_token
        self.nbytes -= gone
        self.stats.evicted_tokens += len(node.key)
        return gone

    def _nodes(self) -> list[Node]:
        out, stack = [], [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def drop_roots(self, stale: Callable[[tuple], bool]) -> None:
        """Forget the trees behind cartridges that are no longer loaded (their K/V can never be asked for again)."""
        for key in [k for k in self.roots if stale(k)]:
            root = self.roots.pop(key)
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                self.nbytes -= len(node.key) * self.bytes_per_token
                stack.extend(node.children.values())

    def clear(self) -> None:
        """Empty the cache (flush_cache, a weight update, release). Rows running keep the tensors they attend to."""
        self.roots, self.nbytes = {}, 0
        self.generation += 1
        self.stats.flushes += 1

    @property
    def tokens(self) -> int:
        return self.nbytes // self.bytes_per_token
