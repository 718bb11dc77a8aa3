"""The single-rank process group helper."""

from __future__ import annotations

import os

import torch.distributed as dist

from final import dist as fdist


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
