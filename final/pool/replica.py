"""Replicas on Ray: the actor that owns one InferenceEngine, and the Ray side of a pool of them.

final.pool.ReplicaPool shares the work out; this module starts, joins and stops Ray, places the actors (a GPU
each, or a share of the CPUs), and translates Ray's exceptions: a replica's own error is raised as InferenceEngine
raised it, and a replica whose process is gone is recognised with Ray's reason. Pools still open at interpreter
exit are shut down (watch_pool).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from final.config import default_config_path, read_yaml
from final.errors import ConfigError, FinalError, ReplicaError


class Replica:
    """One Ray actor's body: an InferenceEngine in the actor's process (ray.remote() is applied by the pool)."""

    def __init__(self, index: int, config: dict, overrides: dict, cwd: str, sys_path: list[str], threads: int):
        # See what the caller sees: relative paths in the config (tools.yaml, cartridges) and importable modules
        # (tool classes named in tools.yaml), where they exist on this node.
        if os.path.isdir(cwd):
            os.chdir(cwd)
        sys.path.extend(p for p in sys_path if p not in sys.path and os.path.exists(p))
        import torch

        torch.set_num_threads(threads)  # Ray's CPU share; more OpenMP threads than cores slows decode
        self.index, self.engine, self.error = index, None, None
        try:
            from final.inf import InferenceEngine

            self.engine = InferenceEngine(config, **overrides)
        except Exception as exc:  # noqa: BLE001 - reported by ready(), so the caller gets the typed error
            self.error = exc

    def ready(self) -> dict:
        if self.error is not None:
            raise self.error
        import ray
        import torch

        return {"index": self.index, "node": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "threads": torch.get_num_threads()}

    def run(self, request: Any):
        """Run a part of a call the pool prepared (final.request.Request)."""
        return self.engine.run(request)

    def load_cartridge(self, kwargs: dict) -> str:
        return self.engine.load_cartridge(**kwargs)

    def unload_cartridge(self, cartridge_id: str) -> bool:
        return self.engine.unload_cartridge(cartridge_id)

    def call(self, fn: Any) -> Any:
        return fn(self.engine)

    def update_weights(self, named: list, keep_cartridges: bool) -> int:
        return self.engine.update_weights(named, keep_cartridges=keep_cartridges)

    def sleep(self, release: bool) -> None:
        """release() or resume() of the engine's memory (veRL's sleep mode)."""
        self.engine.release() if release else self.engine.resume()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


@dataclass
class ReplicaSpec:
    """What starts a replica (the first time and after a death): the config, the caller's overrides, where it runs
    (cwd, sys.path) and its share of the cluster."""

    config: dict
    overrides: dict
    gpus: float
    cpus: float
    runtime_env: dict | None
    cwd: str
    sys_path: list[str]

    def start(self, index: int) -> Any:
        """A new Replica actor (building its engine); its ready() says when it serves."""
        import ray

        actor = ray.remote(Replica).options(num_cpus=self.cpus, num_gpus=self.gpus, max_restarts=0,
                                            runtime_env=self.runtime_env)
        return actor.remote(index, self.config, self.overrides, self.cwd, self.sys_path, max(1, int(self.cpus)))


def replica_spec(replicas: int, config: dict, overrides: dict, num_gpus: float | None, num_cpus: float | None,
                 runtime_env: dict | None) -> ReplicaSpec:
    gpus, cpus = resources(replicas, num_gpus, num_cpus)
    return ReplicaSpec(config, overrides, gpus, cpus, runtime_env, os.getcwd(), list(sys.path))


def start_replicas(replicas: int, spec: ReplicaSpec, timeout: float) -> tuple[list, list[dict]]:
    """Start `replicas` Replica actors and wait until each has built its engine: (actor handles, their info).
    A replica's start-up error (a bad model, a bad tools.yaml) is raised as the InferenceEngine raised it."""
    actors = [spec.start(i) for i in range(replicas)]
    try:
        return actors, wait_ready(actors, spec, timeout)
    except BaseException:
        stop_actors(actors, [])
        raise


def start_one(spec: ReplicaSpec, index: int, timeout: float) -> tuple[Any, dict]:
    """One replica (a restart): its actor and info, or the start's error (its actor ended)."""
    actor = spec.start(index)
    try:
        return actor, wait_ready([actor], spec, timeout, first=index)[0]
    except BaseException:
        stop_actors([actor], [])
        raise


def wait_ready(actors: list, spec: ReplicaSpec, timeout: float, first: int = 0) -> list[dict]:
    import ray

    refs = [a.ready.remote() for a in actors]
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    if pending:
        raise ReplicaError(f"{len(pending)} of {len(refs)} replicas did not start within {timeout:g} s "
                           f"(each asks the Ray cluster for {spec.cpus:g} CPU and {spec.gpus:g} GPU)",
                           {first + refs.index(r): "not started" for r in pending})
    info = []
    for i, ref in enumerate(refs):
        try:
            info.append(ray.get(ref))
        except deaths() as exc:
            raise ReplicaError("a replica died while starting", {first + i: reason(exc)}) from None
        except ray.exceptions.RayTaskError as exc:  # the InferenceEngine's own (typed) error
            raise_cause(exc)
    return info


_ray_lock = threading.Lock()
_ray_users = 0  # pools on the Ray this module initialised (started locally or connected to)


def acquire_ray(address: str | None, replicas: int) -> bool:
    """Make sure Ray is initialised; True if this module did it (then the last pool using it shuts it down)."""
    import logging

    import ray

    global _ray_users
    with _ray_lock:
        if ray.is_initialized():
            if _ray_users == 0:
                return False  # the caller's own Ray (a veRL trainer, a notebook): use it, never stop it
        elif address is None:  # address="local": a private instance, never a cluster that `ray start` left running
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, replicas), include_dashboard=False,
                     log_to_driver=False, logging_level=logging.WARNING)
        else:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        _ray_users += 1
        return True


def release_ray(owned: bool) -> None:
    import ray

    global _ray_users
    if not owned:
        return
    with _ray_lock:
        _ray_users -= 1
        if _ray_users == 0:
            ray.shutdown()


def resources(replicas: int, num_gpus: float | None, num_cpus: float | None) -> tuple[float, float]:
    """Per-replica (GPUs, CPUs), checked against the cluster's totals so a pool that cannot fit fails now."""
    import ray

    total = ray.cluster_resources()
    gpus = float(num_gpus) if num_gpus is not None else (1.0 if total.get("GPU", 0) >= 1 else 0.0)
    cpus = float(num_cpus) if num_cpus is not None else 1.0 if gpus else max(1.0, total.get("CPU", 1) // replicas)
    for name, each in (("GPU", gpus), ("CPU", cpus)):
        if each * replicas > total.get(name, 0):
            raise ConfigError(f"{replicas} replicas x {each:g} {name} need {each * replicas:g} {name}; the Ray "
                              f"cluster has {total.get(name, 0):g}", key="replicas")
    return gpus, cpus


def stop_actors(actors: list, alive: list[int], timeout: float = 60.0) -> None:
    """Shut each live replica's engine down (an SGLang engine has child processes), then end every actor."""
    import ray

    refs = [actors[i].shutdown.remote() for i in alive]
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout)
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - already gone
            pass


def deaths() -> tuple[type[BaseException], ...]:
    """Ray's ways of saying a replica's process is gone (killed, crashed, out of memory, node lost)."""
    from ray import exceptions as rx

    return (rx.RayActorError, rx.WorkerCrashedError, rx.OutOfMemoryError, rx.NodeDiedError, rx.ObjectLostError)


def reason(exc: BaseException) -> str:
    """The line of Ray's message that says why (e.g. "...because it was killed by `ray.kill`.")."""
    import re

    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if line.strip()]
    why = [line for line in lines if "because" in line or "memory" in line.lower()] or lines or [""]
    return f"{type(exc).__name__}: {why[-1]}"


def cause(exc: BaseException) -> BaseException:
    """The replica's own exception inside Ray's RayTaskError."""
    inner = getattr(exc, "cause", None)
    return inner if isinstance(inner, BaseException) else exc


def raise_cause(exc: BaseException) -> None:
    """Re-raise a replica's own exception as InferenceEngine would have raised it (typed errors unwrapped)."""
    inner = cause(exc)
    if isinstance(inner, FinalError):
        raise inner from None  # the message names the cause; Ray's wrapper would only repeat it
    raise inner from exc  # anything else keeps the replica's traceback


def config_dict(config: str | Path | dict | None) -> dict:
    """The config as a dict (None: the default config InferenceEngine() reads, found here): replicas on other nodes
    may not see the caller's file."""
    import copy

    if isinstance(config, dict):
        return copy.deepcopy(config)
    return read_yaml(default_config_path() if config is None else Path(config))


# ---- pools left open at exit -----------------------------------------------------------------------------
_live: "weakref.WeakSet" = weakref.WeakSet()  # open ReplicaPools
_exit_hook: list[bool] = []


def watch_pool(pool: Any) -> None:
    """Shut the pool down at interpreter exit if its owner did not: it would leave replica processes (and a local
    Ray) behind."""
    if not _exit_hook:  # registered after ray.init, so it runs before Ray's own exit hook (atexit is LIFO)
        atexit.register(_shutdown_all)
        _exit_hook.append(True)
    _live.add(pool)


def forget_pool(pool: Any) -> None:
    _live.discard(pool)


def _shutdown_all() -> None:
    for pool in list(_live):
        try:
            pool.shutdown()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
