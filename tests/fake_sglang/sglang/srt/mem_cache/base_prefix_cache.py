"""Mirrors sglang/srt/mem_cache/base_prefix_cache.py (0.5.2): MatchResult."""

from typing import Any, NamedTuple

import torch


class MatchResult(NamedTuple):
    device_indices: torch.Tensor
    last_device_node: Any
    last_host_node: Any
    host_hit_length: int = 0
