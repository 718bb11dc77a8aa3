"""A single-rank torch.distributed process group, as veRL's SGLangRollout expects one to exist.

Environment variables are only set when absent (a launcher's values win), ports are free ones (two engines in
one machine never collide), and the group is destroyed on shutdown only if we created it.
"""

from __future__ import annotations

import os
import random
import socket

import torch
import torch.distributed as dist

_owned = False
_our_env: set[str] = set()
_PORT_TRIES = 5


EPHEMERAL_FLOOR = 32768  # the low end of Linux's default ip_local_port_range (32768-60999)


def free_port(host: str = "127.0.0.1", below: int | None = None) -> int:
    """A port free at this moment, drawn at random under Linux's ephemeral range (and under `below`: SGLang 0.5.12
    derives a gRPC port as port + 10000 and refuses one over 65535). Not the OS's pick: that comes from the
    ephemeral range, and until its user binds it an outgoing connection can take it as its source port
    (EADDRINUSE in a clean-clone CI run)."""
    below = min(below or EPHEMERAL_FLOOR, EPHEMERAL_FLOOR)
    for _ in range(200):
        port = random.randrange(20000, below)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port under {below} on {host}")


def backend_for_device() -> str:
    # veRL broadcasts python objects over gloo and SGLang uses NCCL for CUDA tensors.
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def set_single_rank_env() -> None:
    defaults = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for key, value in defaults.items():
        if key not in os.environ:
            os.environ[key] = value
            _our_env.add(key)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
        _our_env.add("MASTER_PORT")


def ensure_process_group() -> bool:
    """Initialise a world-size-1 group if none exists. Returns True if this call created it (idempotent)."""
    global _owned
    if dist.is_initialized():
        return False
    set_single_rank_env()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        _init_group(rank, world)
    except BaseException:
        _forget_env()  # no group: the variables we set would tell child processes (torchrun-aware) there is one
        raise
    _owned = True
    return True


def _init_group(rank: int, world: int) -> None:
    for attempt in range(_PORT_TRIES):
        try:
            dist.init_process_group(backend=backend_for_device(), rank=rank, world_size=world)
            return
        except dist.DistNetworkError as exc:
            # free_port() only finds a port that was free a moment ago; on a busy machine (Ray, SGLang's
            # subprocesses, parallel tests) another process can bind it before the TCPStore does. A port we
            # picked is re-picked; a launcher's MASTER_PORT is its business, so that error goes up unchanged.
            if "MASTER_PORT" not in _our_env or "EADDRINUSE" not in str(exc) or attempt == _PORT_TRIES - 1:
                raise
            os.environ["MASTER_PORT"] = str(free_port())


def _forget_env() -> None:
    for key in _our_env:
        os.environ.pop(key, None)
    _our_env.clear()


def destroy_process_group() -> None:
    """Destroy the group if we created it (a launcher's group is left alone)."""
    global _owned
    if _owned and dist.is_initialized():
        dist.destroy_process_group()
    _owned = False
    _forget_env()  # a later group picks a fresh port
