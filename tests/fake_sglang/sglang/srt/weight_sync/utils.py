"""Mirrors the name veRL imports from sglang/srt/weight_sync/utils.py (0.5.2): update_weights (weight sync)."""

from sglang._surface import import_surface_only

update_weights = import_surface_only("sglang.srt.weight_sync.utils.update_weights")
