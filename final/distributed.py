"""Data parallelism: N InferenceEngines on Ray actors behind InferenceEngine's own API.

    with open_engine("config.yaml", replicas=2) as engine:     # a ReplicaPool; replicas=1: a plain InferenceEngine
        out = engine.generate(prompts, n=4, temperature=1.0, seed=0)

- Each replica is a Ray actor that builds one InferenceEngine from the same config (one GPU each when the cluster
  has GPUs, CPUs otherwise). A call is checked once (typed errors name global prompt indices), cut into chunks of
  whole prompts (or of one prompt's samples when n is large), and the chunks are handed out as a work queue: a
  replica that finishes early takes the next one. Rows come back as one GenerationOutput in the caller's order.
- Seeds: InferenceEngine gives row i of a call seed+i (final.sampling.row_seed, on the batch and multi-turn
  paths). A chunk whose first row is global row r is sent with seed+r, so every row samples with the seed it has
  on one engine.
- Cartridges are loaded on every replica: any row can then run anywhere, so load sharing and retries need no
  routing, at the cost of one copy per replica (small next to the model).
- A replica that dies (killed, crashed, out of memory) is dropped for good and its unfinished chunk goes back to
  the front of the queue; results are taken once per chunk, so no row is lost or duplicated. With none left,
  ReplicaError names every dead replica and why.
- ray_address=None starts a private local Ray that the last pool using it stops; an address joins an existing
  cluster; a process that already called ray.init() keeps its Ray (and stops it itself).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from final.config import check_ray_address, check_replicas, load_config
from final.errors import EngineError, ReplicaError
from final.replica import (acquire_ray, cause, config_dict, deaths, raise_cause, reason, release_ray, start_replicas,
                           stop_actors)

# A replica runs one chunk at a time (InferenceEngine serializes its calls), so a chunk is that replica's batch.
# More chunks per replica share the load more finely (a fast replica takes more; a dead one loses less); bigger
# chunks keep the engine's batch full (a decode step costs nearly the same for 8 rows as for 32). Hence about
# CHUNKS_PER_REPLICA chunks each, but no fewer than MIN_CHUNK_ROWS rows (or an equal share of a small call).
CHUNKS_PER_REPLICA = 4
MIN_CHUNK_ROWS = 32


def open_engine(config: str | Path | dict | None = None, *, replicas: int | None = None,
                ray_address: str | None = None, **overrides: Any):
    """An InferenceEngine when one replica in this process will do (Ray is never started), else a ReplicaPool.

    replicas / ray_address default to the config's `replicas:` / `ray_address:` keys."""
    cfg = load_config(config, overrides)
    replicas = check_replicas(cfg.replicas if replicas is None else replicas)
    ray_address = check_ray_address(cfg.ray_address if ray_address is None else ray_address)
    if replicas == 1 and ray_address is None:
        from final.inf import InferenceEngine

        return InferenceEngine(config, **overrides)
    return ReplicaPool(config, replicas=replicas, ray_address=ray_address, **overrides)


@dataclass(frozen=True)
class Chunk:
    """Samples [s0, s0+k) of prompts [p0, p1): one InferenceEngine.generate call on one replica."""

    p0: int
    p1: int
    s0: int
    k: int

    def rows(self) -> list[tuple[int, int]]:
        """(prompt, sample) of each row, in the order the replica returns them (prompt-major)."""
        return [(p, s) for p in range(self.p0, self.p1) for s in range(self.s0, self.s0 + self.k)]


def plan_chunks(prompts: int, n: int, replicas: int, max_rows: int, chunk_rows: int | None = None) -> list[Chunk]:
    """Cut prompts x n rows into chunks of about chunk_rows rows (default: see CHUNKS_PER_REPLICA; at most
    max_rows, the engine's running batch). A prompt's samples are split only when n alone exceeds that."""
    rows = prompts * n
    if chunk_rows is None:
        share = -(-rows // replicas)
        chunk_rows = min(max_rows, max(-(-rows // (replicas * CHUNKS_PER_REPLICA)), min(MIN_CHUNK_ROWS, share)))
    size = max(1, chunk_rows)
    if n > size:
        return [Chunk(p, p + 1, s, min(size, n - s)) for p in range(prompts) for s in range(0, n, size)]
    per = size // n
    return [Chunk(p, min(p + per, prompts), 0, n) for p in range(0, prompts, per)]


class ReplicaPool:
    """N InferenceEngines on Ray actors with InferenceEngine's API; one GenerationOutput per call in the caller's
    order, each row's metadata naming the replica that ran it (see the module doc)."""

    def __init__(self, config: str | Path | dict = "config.yaml", *, replicas: int | None = None,
                 ray_address: str | None = None, num_gpus: float | None = None, num_cpus: float | None = None,
                 runtime_env: dict | None = None, chunk_rows: int | None = None, start_timeout_s: float = 600.0,
                 **overrides: Any):
        """num_gpus / num_cpus per replica default to one GPU when the cluster has GPUs, else an equal share of
        its CPUs; runtime_env is Ray's (e.g. a working_dir for a multi-node cluster); chunk_rows overrides the
        chunk size (rows per generate call on a replica)."""
        self.config = load_config(config, overrides)  # a bad config fails here, before Ray starts
        self.replicas = check_replicas(self.config.replicas if replicas is None else replicas)
        address = check_ray_address(self.config.ray_address if ray_address is None else ray_address)
        self.chunk_rows = chunk_rows
        self._dead: dict[int, str] = {}
        self._closed = False
        self._turn = 0
        self._owns_ray = acquire_ray(address, self.replicas)
        try:
            self._actors, self.info = start_replicas(self.replicas, config_dict(config), overrides, num_gpus,
                                                     num_cpus, runtime_env, start_timeout_s)
        except BaseException:
            release_ray(self._owns_ray)
            raise
        _watch(self)

    # ---- public API ----------------------------------------------------------------------------------
    @property
    def alive(self) -> list[int]:
        """Indices of the replicas still serving."""
        return [i for i in range(self.replicas) if i not in self._dead]

    @property
    def actors(self) -> list:
        """The Ray actor handles, by replica index (dead ones included)."""
        return list(self._actors)

    @property
    def dead(self) -> dict[int, str]:
        """Dead replicas: index -> why Ray says it died."""
        return dict(self._dead)

    def generate(self, prompts: Any, *, cartridge: Any = None, tools_kwargs: Any = None, raw: bool = False,
                 progress: bool | None = None, **sampling: Any):
        """InferenceEngine.generate over the replicas: same arguments, same GenerationOutput."""
        return _run_blocking(self.agenerate(prompts, cartridge=cartridge, tools_kwargs=tools_kwargs, raw=raw,
                                            progress=progress, **sampling))

    async def agenerate(self, prompts: Any, *, cartridge: Any = None, tools_kwargs: Any = None, raw: bool = False,
                        progress: bool | None = None, **sampling: Any):
        """Awaitable generate(); cancelling it stops handing out chunks (running ones finish on their replica)."""
        from final.prompts import prompt_items

        self._require_open()
        args = {"prompts": prompts, "cartridge": cartridge, "tools_kwargs": tools_kwargs, "raw": raw, **sampling}
        rows = await self._on_one("check", {**args, "progress": False})  # typed errors with global indices
        items, n = prompt_items(prompts), sampling.get("n", 1)
        chunks = plan_chunks(len(items), n, len(self.alive), self.config.rollout["max_num_seqs"], self.chunk_rows)
        bar = _progress_bar(rows, self.config.progress if progress is None else progress)
        try:
            done = await self._dispatch(chunks, lambda c: self._chunk_args(args, items, c, n), bar)
        finally:
            if bar is not None:
                bar.close()
        return _assemble(chunks, done, n)

    def load_cartridge(self, id: str | None = None, source: str = "local", path: str | None = None,  # noqa: A002
                       force_redownload: bool = False, pin: bool = False) -> str:
        """Load a cartridge on every replica (all or none: a replica that refuses it undoes the others)."""
        self._require_open()
        kwargs = {"id": id, "source": source, "path": path, "force_redownload": force_redownload, "pin": pin}
        results = self._on_all("load_cartridge", kwargs)
        loaded = [r for r, v in results.items() if not isinstance(v, BaseException)]
        failed = [v for v in results.values() if isinstance(v, BaseException)]
        if failed:
            if loaded:
                self._on_all("unload_cartridge", results[loaded[0]], only=loaded)
            raise failed[0]
        ids = set(results.values())
        if len(ids) != 1:
            raise EngineError(f"replicas loaded the cartridge under different ids {sorted(ids)}")
        return ids.pop()

    def unload_cartridge(self, cartridge_id: str) -> bool:
        """Forget a cartridge on every replica; True if a replica had it."""
        self._require_open()
        results = self._on_all("unload_cartridge", cartridge_id)
        for value in results.values():
            if isinstance(value, BaseException):
                raise value
        return any(results.values())

    def call(self, fn: Any, replica: int | None = None) -> Any:
        """Run fn(engine) in each live replica's process (or in one), e.g. to update weights; returns the results
        in replica order (or the one result). fn must be picklable by Ray (cloudpickle)."""
        self._require_open()
        if replica is not None and replica not in self.alive:
            raise ReplicaError(f"replica {replica} is not serving; alive: {self.alive}",
                               {replica: self._dead[replica]} if replica in self._dead else None)
        results = self._on_all("call", fn, only=None if replica is None else [replica])
        for value in results.values():
            if isinstance(value, BaseException):
                raise value
        return results[replica] if replica is not None else [results[r] for r in sorted(results)]

    def shutdown(self) -> None:
        """Stop every replica (its engine first, then its process) and the Ray this pool started, if any."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        try:
            stop_actors(self._actors, self.alive)
        finally:
            release_ray(self._owns_ray)

    def __enter__(self) -> "ReplicaPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- internals -----------------------------------------------------------------------------------
    def _chunk_args(self, args: dict, items: list, chunk: Chunk, n: int) -> dict:
        """generate() arguments for one chunk: its prompts, its per-prompt values, its samples and its seed."""
        out = dict(args, prompts=items[chunk.p0:chunk.p1], n=chunk.k, progress=False)
        cartridge = args["cartridge"]
        # one entry per prompt (as InferenceEngine reads it): each becomes a list or None, so that a slice can
        # never be mistaken for a list of ids composed for every prompt
        if isinstance(cartridge, (list, tuple)) and not all(isinstance(c, str) for c in cartridge):
            out["cartridge"] = [c if c is None else [c] if isinstance(c, str) else list(c)
                                for c in cartridge[chunk.p0:chunk.p1]]
        if isinstance(args["tools_kwargs"], list):
            out["tools_kwargs"] = args["tools_kwargs"][chunk.p0:chunk.p1]
        if args.get("seed") is not None:  # row i of a call samples with seed + i (final.sampling.row_seed)
            out["seed"] = args["seed"] + chunk.p0 * n + chunk.s0  # the chunk's first global row
        return out

    async def _dispatch(self, chunks: list[Chunk], args_for: Any, bar: Any) -> dict[int, tuple[int, Any]]:
        """The work queue: each idle replica takes the next chunk; a dead replica's chunk goes back in front."""
        queue, idle = deque(range(len(chunks))), deque(self.alive)
        running: dict[asyncio.Future, tuple[int, int]] = {}
        done: dict[int, tuple[int, Any]] = {}
        try:
            while queue or running:
                while queue and idle:
                    r = idle.popleft()
                    if r not in self._dead:  # another call may have seen it die
                        c = queue.popleft()
                        running[self._submit(r, "generate", args_for(chunks[c]))] = (r, c)
                if not running:
                    raise self._no_replica_left()
                finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for fut in finished:
                    r, c = running.pop(fut)
                    if self._take(fut, r):
                        done[c] = (r, fut.result())
                        idle.append(r)
                        if bar is not None:
                            bar.update(len(chunks[c].rows()))
                    else:
                        queue.appendleft(c)
        finally:
            for fut in running:  # an error or a cancelled call: drop what is still out (replicas finish it)
                fut.cancel()
        return done

    def _take(self, fut: asyncio.Future, replica: int) -> bool:
        """True if fut holds a result; False if its replica died (now recorded); raises the replica's error."""
        import ray

        try:
            fut.result()
        except deaths() as exc:
            self._bury(replica, exc)
            return False
        except ray.exceptions.RayTaskError as exc:
            raise_cause(exc)
        return True

    def _submit(self, replica: int, method: str, *args: Any) -> asyncio.Future:
        ref = getattr(self._actors[replica], method).remote(*args)
        return asyncio.wrap_future(ref.future())

    async def _on_one(self, method: str, *args: Any) -> Any:
        """Run a method on one live replica (taking turns), moving on to the next if it dies."""
        while self.alive:
            r = self.alive[self._turn % len(self.alive)]
            self._turn += 1
            fut = self._submit(r, method, *args)
            await asyncio.wait([fut])
            if self._take(fut, r):
                return fut.result()
        raise self._no_replica_left()

    def _on_all(self, method: str, *args: Any, only: list[int] | None = None) -> dict[int, Any]:
        """Run a method on every live replica (or those in `only`): replica -> result or its exception."""
        import ray

        targets = [r for r in (only or self.alive) if r not in self._dead]
        refs = {r: getattr(self._actors[r], method).remote(*args) for r in targets}
        results: dict[int, Any] = {}
        for r, ref in refs.items():
            try:
                results[r] = ray.get(ref)
            except deaths() as exc:
                self._bury(r, exc)
            except ray.exceptions.RayTaskError as exc:
                results[r] = cause(exc)
        if not results:
            if not self.alive:
                raise self._no_replica_left()
            raise ReplicaError(f"replicas {targets} died while running {method}",
                               {r: self._dead[r] for r in targets if r in self._dead})
        return results

    def _bury(self, replica: int, exc: BaseException) -> None:
        import ray

        self._dead.setdefault(replica, reason(exc))
        try:  # an unreachable actor could come back: make its death final, so it never returns a row twice
            ray.kill(self._actors[replica])
        except Exception:  # noqa: BLE001 - already gone
            pass

    def _no_replica_left(self) -> ReplicaError:
        return ReplicaError(f"no replica is left: all {self.replicas} replicas of the pool died", self._dead)

    def _require_open(self) -> None:
        if self._closed:
            raise EngineError("this ReplicaPool has been shut down")


def _run_blocking(coro: Any) -> Any:
    """asyncio.run(coro), also from inside a running event loop (a notebook cell), as InferenceEngine allows."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _progress_bar(rows: int, show: bool) -> Any:
    from final.inf import PROGRESS_MIN_ROWS

    if not show or rows < PROGRESS_MIN_ROWS:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=rows, desc="generate", unit="seq")


def _assemble(chunks: list[Chunk], done: dict[int, tuple[int, Any]], n: int):
    """Chunk outputs -> one GenerationOutput, rows prompt-major as InferenceEngine returns them."""
    from final.inf import GenerationOutput

    total = sum(len(c.rows()) for c in chunks)
    completions: list = [None] * total
    token_ids: list = [None] * total
    metadata: list = [None] * total
    for c, (replica, out) in done.items():
        rows = chunks[c].rows()
        if len(out.completions) != len(rows):
            raise EngineError(f"replica {replica} returned {len(out.completions)} rows for a chunk of {len(rows)}")
        for j, (p, s) in enumerate(rows):
            g = p * n + s
            completions[g], token_ids[g] = out.completions[j], out.token_ids[j]
            meta = out.metadata[j] if j < len(out.metadata) else {}
            metadata[g] = {**meta, "prompt_index": p, "sample_index": s, "replica": replica}
    return GenerationOutput(completions, token_ids, metadata, n)


_live: "weakref.WeakSet[ReplicaPool]" = weakref.WeakSet()


_exit_hook: list[bool] = []


def _watch(pool: ReplicaPool) -> None:
    if not _exit_hook:  # registered after ray.init, so it runs before Ray's own exit hook (atexit is LIFO)
        atexit.register(_shutdown_all)
        _exit_hook.append(True)
    _live.add(pool)


def _shutdown_all() -> None:
    # Pools left open at exit would leave replica processes (and a local Ray) behind.
    for pool in list(_live):
        try:
            pool.shutdown()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
