"""The single-rank process group helper."""

from __future__ import annotations

import os

import torch.distributed as dist

from final import process_group as fdist


def test_process_group_is_idempotent_and_cleans_up(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # a launcher's value must be kept
    assert fdist.ensure_process_group() is True
    assert fdist.ensure_process_group() is False
    assert dist.get_world_size() == 1 and dist.get_rank() == 0
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and os.environ["WORLD_SIZE"] == "1"
    fdist.destroy_process_group()
    assert not dist.is_initialized()
    assert "WORLD_SIZE" not in os.environ and os.environ["MASTER_ADDR"] == "127.0.0.1"
    assert fdist.ensure_process_group() is True  # a second group after the first is gone
    fdist.destroy_process_group()
    assert fdist.backend_for_device() in ("gloo", "cpu:gloo,cuda:nccl")


def test_a_port_taken_between_pick_and_bind_is_repicked(monkeypatch):
    """free_port() can hand out a port another process binds before the TCPStore does (a clean-clone CI run:
    EADDRINUSE in scripts/gpu_smoke.py); a port we picked is picked again, a launcher's is left to fail."""
    import socket

    import pytest

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        real = fdist.free_port
        picks = iter([busy])
        monkeypatch.setattr(fdist, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host))
        assert fdist.ensure_process_group() is True
        assert int(os.environ["MASTER_PORT"]) != busy
        fdist.destroy_process_group()
        monkeypatch.setenv("MASTER_PORT", str(busy))  # a launcher's port: its error is the launcher's to see
        with pytest.raises(dist.DistNetworkError):
            fdist.ensure_process_group()
    assert not dist.is_initialized()
    # a failed start leaves no variables behind: a child (lm-eval's accelerate) would take WORLD_SIZE for a group
    assert not {"WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR"} & set(os.environ)
