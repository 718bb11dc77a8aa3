"""Rollout backends behind veRL's BaseRollout.generate_sequences, chosen by `rollout.name`."""

from __future__ import annotations

import importlib

from final.errors import ConfigError

# backend name -> "module:factory"; each factory takes (EngineConfig, RolloutConfig, HFModelConfig).
REGISTRY = {
    "local": "final.rollout.local:build",
    "sglang": "final.rollout.sglang:build",
    "tokasaurus": "final.rollout.tokasaurus:build",
}


def build_rollout(engine_config, rollout_config, model_config):
    backend = engine_config.backend
    if backend not in REGISTRY:
        raise ConfigError(f"unknown backend {backend!r}", key="rollout.name", path=engine_config.source)
    module, factory = REGISTRY[backend].split(":")
    return getattr(importlib.import_module(module), factory)(engine_config, rollout_config, model_config)
