"""Which replica of a pool runs each chunk: the one that holds its prompts' prefix, unless it is much busier.

Each replica's engine keeps its own prefix cache (final/engine/prefix_cache.py), so a conversation's next turn
prefills only its new tokens on the replica that ran the turn before. A pool cannot read its replicas' caches; it
keeps an approximate map instead, as SGLang's router (`cache_aware` policy) and vLLM's prefix-aware routing do:

- Blocks: a prompt's tokens in blocks of BLOCK, each named by a hash chained from the prefix before it (vLLM's
  block hashes) and from what else sets the K/V (the row's cartridges and LoRA adapter), so equal hashes mean an
  equal prefix. The map holds, per block, the replicas that ran it: a chunk's prompts when it is sent there, its
  rows' prompt + output when they come back (what the engine caches). At most MAX_BLOCKS blocks, least recently
  used dropped first; a weight update, a release or a cartridge unload empties it (the engines' caches are
  emptied too), and a replica restarted (an empty cache) is taken out of it.
- Load: rows in flight per replica, over every call of the pool, counted from a chunk's send until its replica
  returns it (a chunk of a cancelled call counts until its replica finishes it).
- Choice (SGLang's, with the load in rows): the replica holding the most of a chunk's prompt tokens takes it if
  it holds more than another serving replica by at least one block and a CACHE_THRESHOLD share of the tokens
  that one would compute (what every replica holds, a shared system prompt served on each, weighs nothing),
  unless it is much busier than the least loaded replica: more than BALANCE_ABS_ROWS rows and BALANCE_REL times
  its rows. Otherwise the
  least loaded replica takes it (ties: the one that has served fewer rows, so unrelated prompts spread even one
  call at a time).

`routing="least_loaded"` (ReplicaPool's option) skips the map: every chunk goes to the least loaded replica.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterator

from final.errors import ConfigError
from final.outputs import GenerationOutput
from final.pool.chunks import Chunk
from final.pool.replicas import Replicas
from final.request import Request

ROUTING = ("cache_aware", "least_loaded")
BLOCK = 16  # tokens a block (the engine's prefix_cache.MIN_HIT: a shorter hit is not used)
MAX_BLOCKS = 1 << 16  # blocks in the map (a few MB), over all replicas
CACHE_THRESHOLD = 0.5  # share of what the least prepared replica would compute that the preferred one holds
# A replica runs one chunk at a time, so a row sent to a busy one waits for everything ahead of it, where a miss
# costs only a prefill: the preferred replica is given up far sooner than in SGLang's router (32 requests and
# 1.1x; 64 and 1.5x in later versions), whose workers batch what they are sent. It also keeps affinity from
# locking in an uneven start (clients sharing a system prompt all pulled to the replica that ran it first).
BALANCE_ABS_ROWS = 1
BALANCE_REL = 1.5


def check_routing(routing: str) -> str:
    if routing not in ROUTING:
        raise ConfigError(f"routing must be one of {', '.join(ROUTING)}, got {routing!r}", key="routing")
    return routing


def block_hashes(tokens: list[int], h: int) -> list[int]:
    """The chained hashes of tokens' whole blocks, from the chain's state h (a trailing partial block has none)."""
    out = []
    for i in range(0, len(tokens) - BLOCK + 1, BLOCK):
        h = hash((h, tuple(tokens[i:i + BLOCK])))
        out.append(h)
    return out


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class Router:
    """One pool's load and prefix map (the module doc); shared by its calls, safe from any thread."""

    def __init__(self, replicas: Replicas, routing: str = "cache_aware"):
        self.replicas, self.routing = replicas, check_routing(routing)
        size = len(replicas.actors)
        self.load = [0] * size  # rows in flight
        self.served = [0] * size  # rows sent, all told
        self.lock = threading.Lock()
        self._blocks: OrderedDict[int, int] = OrderedDict()  # block hash -> bit mask of the replicas that ran it
        self._generation = list(replicas.generation)  # the start of each replica the map describes

    def call(self, request: Request, chunks: list[Chunk]) -> "CallRoute":
        """The routing of one call's chunks."""
        return CallRoute(self, request, chunks)

    def forget(self) -> None:
        """Empty the map: the replicas' caches were emptied (a weight update, a release, a cartridge unload)."""
        with self.lock:
            self._blocks.clear()

    def least_loaded(self, free: list[int]) -> int:
        return min(free, key=lambda r: (self.load[r], self.served[r], r))

    def take(self, replica: int, rows: int) -> None:
        """Rows sent to a replica (call with the lock held)."""
        self.load[replica] += rows
        self.served[replica] += rows

    def release(self, replica: int, rows: int) -> None:
        """Rows a replica returned (or lost): from Ray's thread when its call ends."""
        with self.lock:
            self.load[replica] -= rows

    def much_busier(self, preferred: int, least: int) -> bool:
        high, low = self.load[preferred], self.load[least]
        return high - low > BALANCE_ABS_ROWS and high > BALANCE_REL * low

    # ---- the map (call with the lock held) -------------------------------------------------------------------
    def sync(self) -> int:
        """Take restarted (empty) and dead replicas out of the map; returns the mask of serving replicas."""
        alive = self.replicas.alive
        for r, generation in enumerate(self.replicas.generation):
            if generation != self._generation[r] or r in self.replicas.dead:
                self._generation[r] = generation
                self._drop(r)
        return sum(1 << r for r in alive)

    def _drop(self, replica: int) -> None:
        bit = 1 << replica
        for h in [h for h, mask in self._blocks.items() if mask & bit]:
            mask = self._blocks[h] & ~bit
            if mask:
                self._blocks[h] = mask
            else:
                del self._blocks[h]

    def held(self, hashes: list[int], mask: int) -> dict[int, int]:
        """Replica -> how many of hashes' leading blocks it ran (among the replicas in mask)."""
        depth: dict[int, int] = {}
        for h in hashes:
            mask &= self._blocks.get(h, 0)
            if not mask:
                break
            for r in _bits(mask):
                depth[r] = depth.get(r, 0) + 1
        return depth

    def remember(self, hashes: list[int], replica: int, generation: int) -> None:
        """The replica ran these blocks (on its start `generation`: an older start's news is dropped). The first
        blocks of a chain end up the most recent: eviction takes a chain's tail before its head, as a cache's
        LRU of leaves does."""
        if generation != self._generation[replica] or generation != self.replicas.generation[replica]:
            return
        bit, blocks = 1 << replica, self._blocks
        for h in reversed(hashes):
            blocks[h] = blocks.pop(h, 0) | bit  # to the recent end
        while len(blocks) > MAX_BLOCKS:
            blocks.popitem(last=False)


class CallRoute:
    """Where one call's chunks go: `assign` picks replicas for waiting chunks, `returned` records what ran."""

    def __init__(self, router: Router, request: Request, chunks: list[Chunk]):
        self.router, self.chunks, self.ids = router, chunks, request.ids
        self._gains: dict[int, dict[int, int]] = {}  # chunk -> replica -> its prompt tokens that replica holds
        self.hashes: list[list[int]] | None = None
        if router.routing == "cache_aware" and len(router.load) > 1:
            carts, adapters = request.cartridges, request.adapters
            self.seeds = [hash(("final.pool", repr(carts[p]) if carts else None, adapters[p] if adapters else None))
                          for p in range(len(self.ids))]
            self.hashes = [block_hashes(ids, seed) for ids, seed in zip(self.ids, self.seeds)]

    def assign(self, waiting: list[int], free: list[int]) -> list[tuple[int, int]]:
        """(chunk, replica) for waiting chunks, one per free replica: first the chunks a free replica holds the
        prefix of, then the rest in order to the least loaded. Their rows count as that replica's load."""
        router, free, picks, taken = self.router, list(free), [], set()
        alive = router.replicas.alive
        with router.lock:
            for affine in (True, False):
                for c in (c for c in waiting if c not in taken):
                    if not free:
                        break
                    r = self._affine(c, free, alive) if affine else router.least_loaded(free)
                    if r is None:
                        continue
                    picks.append((c, r))
                    taken.add(c)
                    free.remove(r)
                    router.take(r, len(self.chunks[c].rows()))
                    self._sent_prompts(c, r)
        return picks

    def _affine(self, c: int, free: list[int], alive: list[int]) -> int | None:
        """The free replica holding the most of chunk c's prompts, if it holds enough more than another serving
        replica and is not much busier than the least loaded one."""
        if self.hashes is None or not alive:
            return None
        gains, router = self._gain(c), self.router
        best = max(free, key=lambda r: (gains.get(r, 0), -router.load[r]))
        chunk, least_held = self.chunks[c], min(gains.get(r, 0) for r in alive)
        new = sum(len(self.ids[p]) for p in range(chunk.p0, chunk.p1)) - least_held  # prefilled on the worst one
        extra = gains.get(best, 0) - least_held
        if extra < max(BLOCK, CACHE_THRESHOLD * new) or router.much_busier(best, router.least_loaded(alive)):
            return None
        return best

    def _gain(self, c: int) -> dict[int, int]:
        """Replica -> prompt tokens of chunk c it holds (as the map stood when the call first asked)."""
        if c not in self._gains:
            mask, gains = self.router.sync(), {}
            chunk = self.chunks[c]
            for p in range(chunk.p0, chunk.p1):
                for r, blocks in self.router.held(self.hashes[p], mask).items():
                    gains[r] = gains.get(r, 0) + blocks * BLOCK
            self._gains[c] = gains
        return self._gains[c]

    def _sent_prompts(self, c: int, replica: int) -> None:
        if self.hashes is not None:
            generation = self.router.replicas.generation[replica]
            for p in range(self.chunks[c].p0, self.chunks[c].p1):
                self.router.remember(self.hashes[p], replica, generation)

    def returned(self, c: int, replica: int, generation: int, out: GenerationOutput) -> None:
        """Chunk c came back from the replica: its rows' prompt + output are in that replica's cache now."""
        if self.hashes is None:
            return
        chunk, remember = self.chunks[c], self.router.remember
        with self.router.lock:
            for j, (p, _) in enumerate(chunk.rows()):  # each row's output, after its prompt's whole blocks
                full = len(self.hashes[p])
                tail = list(self.ids[p][full * BLOCK:]) + list(out.token_ids[j] if j < len(out.token_ids) else [])
                remember(block_hashes(tail, self.hashes[p][-1] if full else self.seeds[p]), replica, generation)
            for p in range(chunk.p0, chunk.p1):  # then the prompts: more recent than what follows them
                remember(self.hashes[p], replica, generation)
