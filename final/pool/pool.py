"""Data parallelism: N InferenceEngines on Ray actors behind InferenceEngine's own API.

    with open_engine("config.yaml", replicas=2) as engine:     # a ReplicaPool; replicas=1: a plain InferenceEngine
        out = engine.generate(prompts, n=4, temperature=1.0, seed=0)

- Each replica is a Ray actor that builds one InferenceEngine from the same config (one GPU each when the cluster
  has GPUs, CPUs otherwise). A call is prepared here once, exactly as one InferenceEngine prepares it (typed
  errors name the caller's prompt indices; the same prepare/run/astream API, so `final serve` and evals take a pool
  as they take an engine), cut into chunks of whole prompts (or of one prompt's samples when n is large), and the
  chunks are handed out as a work queue: each replica free of the call's work takes one, a replica that finishes
  early takes the next. Which chunk goes where (router.py): to the replica whose prefix cache holds its prompts'
  prefix (a conversation's earlier turns) unless that one is much busier, else to the replica with the fewest
  rows in flight over every call of the pool. Rows come back as one GenerationOutput in the caller's order.
- Seeds: InferenceEngine gives row i of a call seed+i (final.sampling.row_seed, on the batch and multi-turn
  paths). A chunk whose first row is global row r is sent with seed+r, so every row samples with the seed it has
  on one engine.
- Cartridges are loaded on every replica: any row can then run anywhere, so load sharing and retries do not
  depend on where a cartridge is, at the cost of one copy per replica (small next to the model).
- A replica that dies (killed, crashed, out of memory) is restarted in the background (up to max_restarts times,
  then dropped for good) and brought to the pool's weights and cartridges before it takes rows (replicas.py).
  Its unfinished chunk goes back to the front of the queue, once: a chunk whose second replica dies too fails the
  call with ReplicaError naming both (a row that kills every replica must not kill the pool). Results are taken
  once per chunk, so no row is lost or duplicated; each row reports the pool's weights version. With no replica
  serving and none being restarted, ReplicaError names every dead replica and why.
- limits.max_queued_rows and limits.deadline_s hold at the pool's door as on one engine (OverloadedError,
  DeadlineError); a call cancelled or past its deadline stops handing out chunks, and the chunks already on a
  replica finish there (Ray cannot interrupt a running actor call), their rows dropped.
- ray_address=None starts a private local Ray that the last pool using it stops; an address joins an existing
  cluster; a process that already called ray.init() keeps its Ray (and stops it itself).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, AsyncIterator

from final.admission import Admission
from final.calls import off_loop, progress_bar, run_blocking, within_deadline
from final.config import check_ray_address, check_replicas, load_config
from final.errors import EngineError, ReplicaError
from final.models import resolve_model_path
from final.outputs import Completion, GenerationOutput, Score
from final.request import CallRules, Request, prepare_score
from final.tools.call import Reading, prepare_call
from final.versions import PolicyVersions
from final.weights import named_tensors
from final.pool.chunks import assemble, plan_chunks
from final.pool.dispatch import dispatch
from final.pool.replica import (acquire_ray, config_dict, forget_pool, release_ray, replica_spec, start_replicas,
                                stop_actors, watch_pool)
from final.pool.replicas import Replicas
from final.pool.router import Router, check_routing

POOL_OPTIONS = ("num_gpus", "num_cpus", "runtime_env", "chunk_rows", "start_timeout_s", "max_restarts", "routing")

def open_engine(config: str | Path | dict | None = None, *, replicas: int | None = None,
                ray_address: str | None = None, **overrides: Any):
    """An InferenceEngine when one replica in this process will do (Ray is never started), else a ReplicaPool.

    replicas / ray_address default to the config's `replicas:` / `ray_address:` keys; ReplicaPool's own options
    (num_cpus, max_restarts, ...) go to the pool, the rest are config overrides."""
    options = {k: overrides.pop(k) for k in POOL_OPTIONS if k in overrides}
    cfg = load_config(config, overrides)
    replicas = check_replicas(cfg.replicas if replicas is None else replicas)
    ray_address = check_ray_address(cfg.ray_address if ray_address is None else ray_address)
    if replicas == 1 and ray_address is None:
        from final.inf import InferenceEngine

        return InferenceEngine(config, **overrides)
    return ReplicaPool(config, replicas=replicas, ray_address=ray_address, **options, **overrides)


class ReplicaPool:
    """N InferenceEngines on Ray actors with InferenceEngine's API; one GenerationOutput per call in the caller's
    order, each row's metadata naming the replica that ran it (see the module doc)."""

    def __init__(self, config: str | Path | dict | None = None, *, replicas: int | None = None,
                 ray_address: str | None = None, num_gpus: float | None = None, num_cpus: float | None = None,
                 runtime_env: dict | None = None, chunk_rows: int | None = None, start_timeout_s: float = 600.0,
                 max_restarts: int = 3, routing: str = "cache_aware", **overrides: Any):
        """num_gpus / num_cpus per replica default to one GPU when the cluster has GPUs, else an equal share of
        its CPUs; runtime_env is Ray's (e.g. a working_dir for a multi-node cluster); chunk_rows overrides the
        chunk size (rows per generate call on a replica); max_restarts: how often each replica is restarted after
        its process died before it is dropped for good (0: never); routing: "cache_aware" (a chunk goes to the
        replica holding its prompts' prefix unless that one is much busier, else to the least loaded) or
        "least_loaded" (final.pool.router)."""
        self.config = load_config(config, overrides)  # a bad config fails here, before Ray starts
        self.replicas = check_replicas(self.config.replicas if replicas is None else replicas)
        address = check_ray_address(self.config.ray_address if ray_address is None else ray_address)
        self.chunk_rows = chunk_rows
        routing = check_routing(routing)
        self._closed = False
        self._admission = Admission(self.config.limits.max_queued_rows)
        self._versions = PolicyVersions()  # one version for every replica: no call sees two
        self._owns_ray = acquire_ray(address, self.replicas)
        try:
            spec = replica_spec(self.replicas, config_dict(config), overrides, num_gpus, num_cpus, runtime_env)
            self._replicas = Replicas(spec, *start_replicas(self.replicas, spec, start_timeout_s), max_restarts,
                                      start_timeout_s)
        except BaseException:
            release_ray(self._owns_ray)
            raise
        self._router = Router(self._replicas, routing)
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
        """Indices of the replicas serving (neither dead for good nor being restarted)."""
        return self._replicas.alive

    @property
    def actors(self) -> list:
        """The Ray actor handles, by replica index (each replica's latest start)."""
        return list(self._replicas.actors)

    @property
    def info(self) -> list[dict]:
        """Each replica's node, pid, GPUs and threads (its latest start)."""
        return list(self._replicas.info)

    @property
    def dead(self) -> dict[int, str]:
        """Replicas dropped for good: index -> why Ray says it died (and why its restart failed, if it did)."""
        return dict(self._replicas.dead)

    @property
    def restarts(self) -> list[int]:
        """How many times each replica has been restarted after its process died."""
        return list(self._replicas.restarts)

    @property
    def load(self) -> list[int]:
        """Rows in flight per replica, over every call: sent and not yet returned (final.pool.router)."""
        return list(self._router.load)

    @property
    def routing(self) -> str:
        """"cache_aware" (a chunk goes to the replica holding its prompts' prefix unless that one is much busier)
        or "least_loaded"; settable, for the calls that start after."""
        return self._router.routing

    @routing.setter
    def routing(self, value: str) -> None:
        self._router.routing = check_routing(value)

    @property
    def max_restarts(self) -> int:
        """Restarts allowed per replica before it is dropped for good."""
        return self._replicas.max_restarts

    @max_restarts.setter
    def max_restarts(self, value: int) -> None:
        self._replicas.max_restarts = value

    def wait_for_replicas(self, timeout: float | None = None) -> list[int]:
        """Wait until no replica is being restarted (each then serves the pool's weights and cartridges, or is
        dead for good); returns the replicas serving."""
        return self._replicas.wait(timeout)

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
        """Run a prepared request: its chunks go to the replicas free of it, each to the one holding its prefix or
        else the least loaded (see the module doc)."""
        self._require_open()
        if not self.alive and not self._replicas.restarting:
            raise self._replicas.none_left()
        with self._admission.hold(request.rows):
            return await within_deadline(self._arun(request), self.config.limits.deadline_s)

    async def _arun(self, request: Request) -> GenerationOutput:
        async with self._versions.areading() as version:
            return await self._arun_chunks(request, version)

    async def _arun_chunks(self, request: Request, version: int) -> GenerationOutput:
        n = request.n
        chunks = plan_chunks(len(request.ids), n, len(self.alive), self.rollout_config.max_num_seqs, self.chunk_rows)
        bar = progress_bar(request.rows) if request.show_progress else None
        try:
            done = await dispatch(self._replicas, self._router.call(request, chunks), chunks,
                                  lambda c: request.part(c.p0, c.p1, c.s0, c.k), bar)
        finally:
            if bar is not None:
                bar.close()
        return assemble(chunks, done, n, version)

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
        with self._replicas.lock:  # a replica restarted meanwhile loads it from the record
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
            self._replicas.loaded(cid, kwargs)
        if self._cartridges is not None and cid not in self._cartridges:
            self._cartridges.append(cid)
        return cid

    def unload_cartridge(self, cartridge_id: str) -> bool:
        """Forget a cartridge on every replica; True if a replica had it."""
        self._require_open()
        with self._replicas.lock:
            results = self._on_all_or_raise("unload_cartridge", cartridge_id)
            self._replicas.unloaded(cartridge_id)
        self._router.forget()  # what the replicas cached behind it is gone
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
            dead = self._replicas.dead
            raise ReplicaError(f"replica {replica} is not serving; alive: {self.alive}",
                               {replica: dead[replica]} if replica in dead else None)
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
        with self._versions.writing() as version, self._replicas.lock:
            ref = ray.put(named)
            self._on_all_or_raise("update_weights", ref, keep_cartridges)
            self._replicas.updated(ref, [name for name, _ in named], keep_cartridges)  # what a restart replays
            self._router.forget()  # each replica emptied its prefix cache
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
            if release:
                self._router.forget()  # release() frees each replica's prefix cache

    def shutdown(self) -> None:
        """Stop every replica (its engine first, then its process) and the Ray this pool started, if any."""
        if self._closed:
            return
        self._closed = True
        forget_pool(self)
        try:
            stop_actors(self._replicas.actors, self._replicas.close())
        finally:
            release_ray(self._owns_ray)

    def __enter__(self) -> "ReplicaPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- internals -----------------------------------------------------------------------------------
    def _on_all(self, method: str, *args: Any, only: list[int] | None = None) -> dict[int, Any]:
        """Run a method on every serving replica (or those in `only`): replica -> result or its exception."""
        return self._replicas.on_all(method, *args, only=only)

    def _on_all_or_raise(self, method: str, *args: Any, only: list[int] | None = None) -> dict[int, Any]:
        """_on_all, raising the first replica's error (a typed error, as the replica's engine raised it)."""
        results = self._on_all(method, *args, only=only)
        for value in results.values():
            if isinstance(value, BaseException):
                raise value
        return results

    def _require_open(self) -> None:
        if self._closed:
            raise EngineError("this ReplicaPool has been shut down")


def _cartridge_usage(engine: Any) -> dict | None:
    return engine.cartridge_usage()


def _tokenizer(config: Any) -> Any:
    """The model's tokenizer, as InferenceEngine loads it (veRL's HFModelConfig)."""
    model_config = config.model_config(resolve_model_path(config.model_path))
    return getattr(model_config.tokenizer, "tokenizer", model_config.tokenizer)
