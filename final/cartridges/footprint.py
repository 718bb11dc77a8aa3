"""Measure the KV memory of rows that share cartridges: proof that a cartridge is held once, not per row.

`kv_footprint` runs on the engine thread between steps and counts the bytes of the distinct storages behind
the running rows' cartridge prefixes (two views of one tensor count once). `measure_sharing` runs `rows`
identical requests with the same cartridges and returns the footprint seen while all of them were running.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Sequence

import torch


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def kv_footprint(engine: Any) -> dict[str, int]:
    """Row cache bytes and distinct cartridge-prefix bytes of the rows running right now."""

    def snap(_runner: Any) -> dict[str, int]:
        running = list(engine.scheduler.running)
        prefixes = {id(s.prefix): s.prefix for s in running if s.prefix is not None}
        tensors = [t for p in prefixes.values() for t in p.k + p.v]
        return {"running_rows": len(running), "rows_with_cartridge": sum(s.prefix is not None for s in running),
                "distinct_prefixes": len(prefixes), "prefix_bytes": storage_bytes(tensors),
                "row_cache_bytes": engine.cache.nbytes, "cartridge_table_bytes": engine.prefixes.nbytes}

    return engine.call(snap)


def measure_sharing(engine: Any, cartridges: tuple[str, ...], prompt_ids: list[int], rows: int,
                    max_new_tokens: int = 16) -> dict[str, int]:
    """Run `rows` requests on the same cartridges; return the footprint observed with the most rows running."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(engine.async_generate(input_ids=[list(prompt_ids)] * rows, sampling_params=params,
                                              cartridges=cartridges))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)
        finally:
            done.set()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    best: dict[str, int] = {"running_rows": 0}
    while not done.is_set():
        snap = kv_footprint(engine)
        if snap["running_rows"] > best["running_rows"]:
            best = snap
    worker.join()
    if errors:
        raise errors[0]
    return best
