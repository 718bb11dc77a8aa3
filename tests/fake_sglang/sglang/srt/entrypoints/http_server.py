"""Mirrors the name veRL imports from sglang/srt/entrypoints/http_server.py (0.5.2): launch_server (server mode)."""

from sglang._surface import import_surface_only

launch_server = import_surface_only("sglang.srt.entrypoints.http_server.launch_server")
