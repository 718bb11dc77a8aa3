"""Cartridges: trained KV caches served as a prefilled prefix (format, manifest, sources, store, build/verify)."""

from final.cartridges.format import CartridgeKV, load_cartridge, save_cartridge
from final.cartridges.manifest import CartridgeManifest, ModelShape, manifest_path, read_manifest
from final.cartridges.service import CartridgeService, parse_spec
from final.cartridges.store import CartridgeStore

__all__ = ["CartridgeKV", "CartridgeManifest", "CartridgeService", "CartridgeStore", "ModelShape", "load_cartridge",
           "manifest_path", "parse_spec", "read_manifest", "save_cartridge"]
