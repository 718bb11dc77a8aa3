"""Cartridges: trained KV caches served as a prefilled prefix (format, manifest, sources, store, build, service).

Names are imported on first use so that `final.cartridge_commands` (loaded by every `final` command) stays light.
"""

import importlib

_EXPORTS = {
    "CartridgeKV": "format", "load_cartridge": "format", "save_cartridge": "format",
    "CartridgeManifest": "manifest", "ModelShape": "manifest", "manifest_path": "manifest", "read_manifest": "manifest",
    "CartridgeService": "service", "parse_spec": "service", "CartridgeStore": "store",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"final.cartridges.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'final.cartridges' has no attribute {name!r}")
