"""A pool's replicas over time: which serve, which are being restarted, which died for good, and what a new one
must be brought to before it takes rows.

A replica whose process dies (killed, crashed, out of memory) is ended (ray.kill: an unreachable actor that came
back would return a row twice) and started again in the background, from the same config, up to `max_restarts`
times. Before it serves again it replays, in order, the weight updates the pool has applied (an update whose
parameters a later one covers whole is dropped from the record) and loads the cartridges the pool holds, with
the arguments they were loaded with; only then is it among `alive`. The record and the replay share one lock, so
an update or a cartridge load that happens during a restart reaches the new replica once: before it is alive
(through the record) or after (as every live replica gets it).

Each start of a replica is a generation: a result or a death from an older one (an actor already replaced) is
recognised and ignored.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass
from typing import Any

from final.errors import ReplicaError
from final.pool.replica import ReplicaSpec, cause, deaths, reason, start_one, stop_actors


@dataclass
class _Update:
    ref: Any  # Ray ObjectRef of [(name, tensor), ...]
    names: frozenset[str]


class Replicas:
    def __init__(self, spec: ReplicaSpec, actors: list, info: list[dict], max_restarts: int, timeout: float):
        self.spec, self.max_restarts, self.timeout = spec, max_restarts, timeout
        self.actors, self.info = list(actors), list(info)
        self.generation = [0] * len(actors)
        self.restarts = [0] * len(actors)  # restarts done, per replica
        self.dead: dict[int, str] = {}  # died for good: index -> why
        self.restarting: dict[int, concurrent.futures.Future] = {}
        self.lock = threading.RLock()  # the record below, and which replicas serve
        self._updates: list[_Update] = []
        self._cartridges: dict[str, dict] = {}  # id -> load_cartridge's arguments
        self._closed = False

    @property
    def alive(self) -> list[int]:
        """Serving replicas. Read without the lock (a call's work queue must not wait for a cartridge load): a
        restarted replica is in `restarting` until its handle, generation and replay are in place."""
        restarting, dead = set(self.restarting), set(self.dead)
        return [i for i in range(len(self.actors)) if i not in dead and i not in restarting]

    def none_left(self) -> ReplicaError:
        return ReplicaError(f"no replica is left: all {len(self.actors)} replicas of the pool died", dict(self.dead))

    def on_all(self, method: str, *args: Any, only: list[int] | None = None) -> dict[int, Any]:
        """Run a Replica method on every serving replica (or those of `only` that serve): replica -> its result or
        its own exception. A replica that died meanwhile is buried; none answering is ReplicaError."""
        import ray

        alive = self.alive
        handles = {r: self.handle(r) for r in (only or alive) if r in alive}
        refs = {r: getattr(actor, method).remote(*args) for r, (actor, _) in handles.items()}
        results: dict[int, Any] = {}
        for r, ref in refs.items():
            try:
                results[r] = ray.get(ref)
            except deaths() as exc:
                self.bury(r, handles[r][1], exc)
            except ray.exceptions.RayTaskError as exc:
                results[r] = cause(exc)
        if not results:
            if not self.alive and not self.restarting:
                raise self.none_left()
            raise ReplicaError(f"replicas {sorted(handles)} died while running {method}",
                               {r: self.dead.get(r, "died (being restarted)") for r in handles})
        return results

    def handle(self, replica: int) -> tuple[Any, int]:
        """The replica's actor and its generation (to tell a later death of this start from an older one's)."""
        return self.actors[replica], self.generation[replica]

    # ---- the record a new replica replays -----------------------------------------------------------------
    def updated(self, ref: Any, names: list[str], keep_cartridges: bool) -> None:
        """A weight update every live replica applied (call with `lock` held, around the update)."""
        names = frozenset(names)
        self._updates = [u for u in self._updates if not u.names <= names] + [_Update(ref, names)]
        if not keep_cartridges:  # the replicas unloaded their cartridges (made for the old weights)
            self._cartridges.clear()

    def loaded(self, cartridge_id: str, kwargs: dict) -> None:
        self._cartridges[cartridge_id] = {**kwargs, "id": cartridge_id, "force_redownload": False}

    def unloaded(self, cartridge_id: str) -> None:
        self._cartridges.pop(cartridge_id, None)

    # ---- deaths and restarts --------------------------------------------------------------------------------
    def bury(self, replica: int, generation: int, exc: BaseException) -> str:
        """The replica's process died (as seen by a call on `generation`): end it and restart it, or mark it
        dead for good once its restarts are spent. Returns why it died."""
        import ray

        why = reason(exc)
        with self.lock:
            if generation != self.generation[replica] or replica in self.dead or replica in self.restarting:
                return why  # an older start's death, or already handled
            try:
                ray.kill(self.actors[replica])
            except Exception:  # noqa: BLE001 - already gone
                pass
            if self._closed or self.restarts[replica] >= self.max_restarts:
                self.dead[replica] = why
                return why
            self.restarts[replica] += 1
            future: concurrent.futures.Future = concurrent.futures.Future()
            self.restarting[replica] = future
        threading.Thread(target=self._restart, args=(replica, why, future), name=f"final-pool-restart-{replica}",
                         daemon=True).start()
        return why

    def _restart(self, replica: int, why: str, future: concurrent.futures.Future) -> None:
        actor = None
        try:
            actor, info = start_one(self.spec, replica, self.timeout)
            with self.lock:  # no update or cartridge load can slip between the replay and serving
                self._replay(actor)
                if self._closed:
                    raise ReplicaError("the pool was shut down during the restart")
                self.actors[replica], self.info[replica] = actor, info
                self.generation[replica] += 1
                del self.restarting[replica]
            future.set_result(replica)
        except BaseException as exc:  # noqa: BLE001 - recorded: the replica is dead for good
            if actor is not None:
                stop_actors([actor], [0])
            with self.lock:
                self.dead[replica] = f"{why}; its restart failed: {type(exc).__name__}: {exc}"
                self.restarting.pop(replica, None)
            future.set_result(None)

    def _replay(self, actor: Any) -> None:
        import ray

        for update in self._updates:
            ray.get(actor.update_weights.remote(update.ref, True), timeout=self.timeout)
        for kwargs in self._cartridges.values():
            ray.get(actor.load_cartridge.remote(kwargs), timeout=self.timeout)

    def wait(self, timeout: float | None = None) -> list[int]:
        """Wait until no replica is being restarted; returns the replicas serving then."""
        with self.lock:
            pending = list(self.restarting.values())
        concurrent.futures.wait(pending, timeout=timeout)
        return self.alive

    def close(self) -> list[int]:
        """No more restarts; returns the replicas serving now (a restart under way ends its own actor)."""
        with self.lock:
            self._closed = True
            return self.alive
