"""The work queue of one pool call: chunks handed to the replicas free of this call's work, each to the one its
route picks (final.pool.router: the replica holding its prefix, else the least loaded over every call), a dead
replica's chunk put back in front once (final.pool's module doc)."""

from __future__ import annotations

import asyncio
from typing import Any

from final.errors import ReplicaError
from final.pool.chunks import Chunk
from final.pool.replica import deaths, raise_cause
from final.pool.replicas import Replicas
from final.pool.router import CallRoute


async def dispatch(replicas: Replicas, route: CallRoute, chunks: list[Chunk], args_for: Any,
                   bar: Any) -> dict[int, tuple[int, Any]]:
    """Run every chunk once: chunk index -> (replica, its output). Each serving replica without a chunk of this call
    may take one (route.assign says which); with nothing running, the call waits for a replica being restarted."""
    waiting = list(range(len(chunks)))
    lost: dict[int, list[tuple[int, str]]] = {}  # chunk -> replicas that died running it, and why
    running: dict[asyncio.Future, tuple[int, int, int]] = {}  # -> (replica, its generation, chunk)
    done: dict[int, tuple[int, Any]] = {}
    try:
        while waiting or running:
            busy = {r for r, _, _ in running.values()}
            for c, r in route.assign(waiting, [r for r in replicas.alive if r not in busy]):
                waiting.remove(c)
                fut, gen = _submit(replicas, route, r, len(chunks[c].rows()), args_for(chunks[c]))
                running[fut] = (r, gen, c)
            restarts = {asyncio.wrap_future(f) for f in replicas.restarting.values()}
            if not running and not restarts:
                raise replicas.none_left()
            finished, _ = await asyncio.wait(set(running) | restarts, return_when=asyncio.FIRST_COMPLETED)
            for fut in finished & set(running):
                r, gen, c = running.pop(fut)
                why = _death(replicas, fut, r, gen)
                if why is None:
                    done[c] = (r, fut.result())
                    route.returned(c, r, gen, done[c][1])
                    if bar is not None:
                        bar.update(len(chunks[c].rows()))
                    continue
                lost.setdefault(c, []).append((r, why))
                if len(lost[c]) > 1:
                    rows = chunks[c].rows()
                    raise ReplicaError(f"rows {rows[0]}..{rows[-1]} (prompt, sample) were lost twice: the replicas "
                                       "running them died", dict(lost[c]))
                waiting.insert(0, c)
    finally:
        for fut in running:  # an error or a cancelled call: drop what is still out (replicas finish it)
            fut.cancel()
    return done


def _death(replicas: Replicas, fut: asyncio.Future, replica: int, generation: int) -> str | None:
    """None if fut holds a result; why its replica died if it did (the replica is now being restarted, or dead for
    good); raises the replica's own error."""
    import ray

    try:
        fut.result()
    except deaths() as exc:
        return replicas.bury(replica, generation, exc)
    except ray.exceptions.RayTaskError as exc:
        raise_cause(exc)
    return None


def _submit(replicas: Replicas, route: CallRoute, replica: int, rows: int, request: Any) -> tuple[asyncio.Future, int]:
    """Send a chunk's request to the replica. Its rows stay the replica's load until the replica ends the call (a
    result, an error or its death), even if this call stops waiting for it first."""
    actor, generation = replicas.handle(replica)
    try:
        ref = actor.run.remote(request)
    except BaseException:
        route.router.release(replica, rows)
        raise
    ref.future().add_done_callback(lambda _: route.router.release(replica, rows))
    return asyncio.wrap_future(ref.future()), generation
