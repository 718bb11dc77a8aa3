"""Data parallelism: N InferenceEngines on Ray actors behind InferenceEngine's own API.

    with open_engine("config.yaml", replicas=2) as engine:     # a ReplicaPool; replicas=1: a plain InferenceEngine
        out = engine.generate(prompts, n=4, temperature=1.0, seed=0)

- Each replica is a Ray actor that builds one InferenceEngine from the same config (one GPU each when the cluster
  has GPUs, CPUs otherwise). A call is prepared here once, exactly as one InferenceEngine prepares it (typed
  errors name the caller's prompt indices; the same prepare/run/astream API, so `final serve` and evals take a pool
  as they take an engine), cut into chunks of whole prompts (or of one prompt's samples when n is large), and the
  chunks are handed out as a work queue: a replica that finishes early takes the next one. Rows come back as one
  GenerationOutput in the caller's order.
- Seeds: InferenceEngine gives row i of a call seed+i (final.sampling.row_seed, on the batch and multi-turn
  paths). A chunk whose first row is global row r is sent with seed+r, so every row samples with the seed it has
  on one engine.
- Cartridges are loaded on every replica: any row can then run anywhere, so load sharing and retries need no
  routing, at the cost of one copy per replica (small next to the model).
- A replica that dies (killed, crashed, out of memory) is dropped for good and its unfinished chunk goes back to
  the front of the queue; results are taken once per chunk, so no row is lost or duplicated. With none left,
  ReplicaError names every dead replica and why.
- limits.max_queued_rows and limits.deadline_s hold at the pool's door as on one engine (OverloadedError,
  DeadlineError); a call cancelled or past its deadline stops handing out chunks, and the chunks already on a
  replica finish there (Ray cannot interrupt a running actor call), their rows dropped.
- ray_address=None starts a private local Ray that the last pool using it stops; an address joins an existing
  cluster; a process that already called ray.init() keeps its Ray (and stops it itself).
"""

from __future__ import annotations

import asyncio
from collections import deque
from pathlib import Path
from typing import Any, AsyncIterator

from final.admission import Admission
from final.calls import off_loop, progress_bar, run_blocking, within_deadline
from final.config import check_ray_address, check_replicas, load_config
from final.errors import EngineError, ReplicaError
from final.outputs import Completion, GenerationOutput, Score
from final.request import CallRules, Request, prepare_score
from final.tools.call import Reading, prepare_call
from final.versions import PolicyVersions
from final.weights import named_tensors
from final.pool.chunks import Chunk, assemble, plan_chunks
from final.pool.replica import (acquire_ray, cause, config_dict, deaths, forget_pool, raise_cause, reason,
                                release_ray, start_replicas, stop_actors, watch_pool)

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


class ReplicaPool:
    """N InferenceEngines on Ray actors with InferenceEngine's API; one GenerationOutput per call in the caller's
    order, each row's metadata naming the replica that ran it (see the module doc)."""

    def __init__(self, config: str | Path | dict | None = None, *, replicas: int | None = None,
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
        self._admission = Admission(self.config.limits.max_queued_rows)
        self._versions = PolicyVersions()  # one version for every replica: no call sees two
        self._owns_ray = acquire_ray(address, self.replicas)
        try:
            self._actors, self.info = start_replicas(self.replicas, config_dict(config), overrides, num_gpus,
                                                     num_cpus, runtime_env, start_timeout_s)
        except BaseException:
            release_ray(self._owns_ray)
            raise
        watch_pool(self)
        try:  # calls are prepared here, exactly as one InferenceEngine prepares them, then run on the replicas
            facts = self.call(lambda engine: engine.facts(), replica=0)
            self.backend, self.capabilities = facts["backend"], facts["capabilities"]
            self.eos_token_ids, self.pad_token_id = facts["eos_token_ids"], facts["pad_token_id"]
            self._tool_schemas, self._cartridges = facts["tool_schemas"], facts["cartridge_ids"]
            self.rollout_config = self.config.rollout_config()
            self.tokenizer = _tokenizer(self.config)
        except BaseException:
            self.shutdown()
            raise

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

    @property
    def rules(self) -> CallRules:
        """What preparing a call needs (final.request.CallRules): the replicas' backend, this pool's tokenizer."""
        rollout = self.rollout_config
        tools = self.tool_names() if rollout.multi_turn.enable else None
        return CallRules(self.tokenizer, rollout.prompt_length, rollout.response_length, self.config.limits,
                         self.backend, self.capabilities, tools, self.cartridge_ids, self.cartridge_ids,
                         self.config.progress)

    def prepare(self, prompts: Any, *, cartridge: Any = None, tools_kwargs: Any = None, raw: bool = False,
                progress: bool | None = None, **sampling: Any) -> Request:
        """InferenceEngine.prepare: every check of a call (typed errors name the caller's prompt indices)."""
        self._require_open()
        return prepare_call(prompts, self.rules, Reading.of(self.config), sampling=sampling, raw=raw,
                            cartridge=cartridge, tools_kwargs=tools_kwargs, progress=progress)

    def generate(self, prompts: Any, *, cartridge: Any = None, tools_kwargs: Any = None, raw: bool = False,
                 progress: bool | None = None, **sampling: Any) -> GenerationOutput:
        """InferenceEngine.generate over the replicas: same arguments, same GenerationOutput."""
        return self.run(self.prepare(prompts, cartridge=cartridge, tools_kwargs=tools_kwargs, raw=raw,
                                     progress=progress, **sampling))

    async def agenerate(self, prompts: Any, *, cartridge: Any = None, tools_kwargs: Any = None, raw: bool = False,
                        progress: bool | None = None, **sampling: Any) -> GenerationOutput:
        """Awaitable generate(); cancelling it stops handing out chunks (running ones finish on their replica)."""
        return await self.arun(self.prepare(prompts, cartridge=cartridge, tools_kwargs=tools_kwargs, raw=raw,
                                            progress=progress, **sampling))

    def score(self, prompts: Any, continuations: Any = None, *, top_logprobs: int = 0, cartridge: Any = None,
              raw: bool = False) -> list[Score]:
        """InferenceEngine.score over the replicas (each prompt is scored whole on one of them)."""
        self._require_open()
        request = prepare_score(prompts, continuations, self.rules, top_logprobs=top_logprobs, raw=raw,
                                cartridge=cartridge)
        return request.scores(self.run(request).metadata)

    def run(self, request: Request) -> GenerationOutput:
        """Run a prepared call on the replicas (blocking): one GenerationOutput in the caller's order."""
        return run_blocking(self.arun(request))

    async def arun(self, request: Request) -> GenerationOutput:
        """Run a prepared request: its chunks go to whichever replica is free (see the module doc)."""
        self._require_open()
        if not self.alive:
            raise self._no_replica_left()
        with self._admission.hold(request.rows):
            return await within_deadline(self._arun(request), self.config.limits.deadline_s)

    async def _arun(self, request: Request) -> GenerationOutput:
        async with self._versions.areading():
            return await self._arun_chunks(request)

    async def _arun_chunks(self, request: Request) -> GenerationOutput:
        n = request.n
        chunks = plan_chunks(len(request.ids), n, len(self.alive), self.rollout_config.max_num_seqs, self.chunk_rows)
        bar = progress_bar(request.rows) if request.show_progress else None
        try:
            done = await self._dispatch(chunks, lambda c: request.part(c.p0, c.p1, c.s0, c.k), bar)
        finally:
            if bar is not None:
                bar.close()
        return assemble(chunks, done, n)

    async def astream(self, request: Request) -> AsyncIterator[Completion]:
        """InferenceEngine.astream: replicas return whole rows, so each arrives once, complete."""
        for row in (await self.arun(request)).rows():
            yield row

    def tool_schemas(self) -> list[dict]:
        """The tools' OpenAI schemas, as every replica offers them."""
        return list(self._tool_schemas)

    def tool_names(self) -> list[str]:
        """The names of the tools every replica offers."""
        return [t["function"]["name"] for t in self._tool_schemas]

    def cartridge_ids(self) -> list[str] | None:
        """Cartridges loaded on every replica (None: the backend keeps no cartridge store)."""
        return None if self._cartridges is None else list(self._cartridges)

    def adapter_names(self) -> list[str]:
        """LoRA adapters a call may name: none (load adapters on an InferenceEngine; `final serve` lists these)."""
        return []

    def load_cartridge(self, id: str | None = None, source: str = "local", path: str | None = None,  # noqa: A002
                       force_redownload: bool = False, pin: bool = False, positions: str | None = None) -> str:
        """Load a cartridge on every replica (all or none: a replica that refuses it undoes the others)."""
        self._require_open()
        kwargs = {"id": id, "source": source, "path": path, "force_redownload": force_redownload, "pin": pin,
                  "positions": positions}
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
        cid = ids.pop()
        if self._cartridges is not None and cid not in self._cartridges:
            self._cartridges.append(cid)
        return cid

    def unload_cartridge(self, cartridge_id: str) -> bool:
        """Forget a cartridge on every replica; True if a replica had it."""
        self._require_open()
        results = self._on_all_or_raise("unload_cartridge", cartridge_id)
        if self._cartridges is not None and cartridge_id in self._cartridges:
            self._cartridges.remove(cartridge_id)
        return any(results.values())

    def cartridge_usage(self) -> dict | None:
        """InferenceEngine.cartridge_usage of every live replica (each holds its own copy and references), under
        "replicas" in replica order; None when the backend keeps no cartridge store."""
        if self._cartridges is None:
            return None
        return {"cartridges": None, "metrics": None, "replicas": self.call(_cartridge_usage)}

    def call(self, fn: Any, replica: int | None = None) -> Any:
        """Run fn(engine) in each live replica's process (or in one), e.g. to update weights; returns the results
        in replica order (or the one result). fn must be picklable by Ray (cloudpickle)."""
        self._require_open()
        if replica is not None and replica not in self.alive:
            raise ReplicaError(f"replica {replica} is not serving; alive: {self.alive}",
                               {replica: self._dead[replica]} if replica in self._dead else None)
        results = self._on_all_or_raise("call", fn, only=None if replica is None else [replica])
        return results[replica] if replica is not None else [results[r] for r in sorted(results)]

    # ---- weights -------------------------------------------------------------------------------------
    def update_weights(self, weights: Any, *, keep_cartridges: bool = False) -> int:
        """InferenceEngine.update_weights on every live replica before it returns: read here (a path too), put in
        Ray's object store once, checked whole and applied by each replica (a bad update: refused by all). Calls
        in flight finish first, later ones wait: no call is served on two versions."""
        import ray

        self._require_open()
        named = [(name, t.detach().to("cpu")) for name, t in named_tensors(weights)]
        with self._versions.writing() as version:
            self._on_all_or_raise("update_weights", ray.put(named), keep_cartridges)
        return version

    async def aupdate_weights(self, weights: Any, *, keep_cartridges: bool = False) -> int:
        """update_weights() from an event loop (a server)."""
        return await off_loop(self.update_weights, weights, keep_cartridges=keep_cartridges)

    @property
    def weights_version(self) -> int:
        """Updates applied to every replica; each row's metadata carries its replica's (the same) version."""
        return self._versions.version

    def release(self) -> None:
        """InferenceEngine.release on every replica, once the calls in flight have finished."""
        self._sleep(True)

    def resume(self) -> None:
        """InferenceEngine.resume on every replica (a call resumes by itself too)."""
        self._sleep(False)

    def _sleep(self, release: bool) -> None:
        self._require_open()
        with self._versions.exclusive():
            self._on_all_or_raise("sleep", release)

    def shutdown(self) -> None:
        """Stop every replica (its engine first, then its process) and the Ray this pool started, if any."""
        if self._closed:
            return
        self._closed = True
        forget_pool(self)
        try:
            stop_actors(self._actors, self.alive)
        finally:
            release_ray(self._owns_ray)

    def __enter__(self) -> "ReplicaPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- internals -----------------------------------------------------------------------------------
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
                        running[self._submit(r, "run", args_for(chunks[c]))] = (r, c)
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

    def _on_all_or_raise(self, method: str, *args: Any, only: list[int] | None = None) -> dict[int, Any]:
        """_on_all, raising the first replica's error (a typed error, as the replica's engine raised it)."""
        results = self._on_all(method, *args, only=only)
        for value in results.values():
            if isinstance(value, BaseException):
                raise value
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


def _cartridge_usage(engine: Any) -> dict | None:
    return engine.cartridge_usage()


def _tokenizer(config: Any) -> Any:
    """The model's tokenizer, as InferenceEngine loads it (veRL's HFModelConfig)."""
    from final.models import resolve_model_path

    model_config = config.model_config(resolve_model_path(config.model_path))
    return getattr(model_config.tokenizer, "tokenizer", model_config.tokenizer)
