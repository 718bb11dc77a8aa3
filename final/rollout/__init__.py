"""Rollout backends behind one interface (final/rollout/base.py), chosen by `rollout.name`.

local       final/rollout/local.py       the embedded engine, in this process
sglang      final/rollout/sglang/        veRL 0.6.0's SGLangRollout on an in-process SGLang 0.5.2 (verl06 lane,
                                         rollout_052.py), SGLang 0.5.12's Engine in-process (verl09, rollout_0512.py)
tokasaurus  final/rollout/tokasaurus.py  a Tokasaurus server (or `final serve`) over HTTP
"""

from __future__ import annotations

import importlib
from typing import Any

from final.compat import SGLANG_ROLLOUT
from final.errors import ConfigError
from final.rollout.base import Backend, Capabilities, Observer

__all__ = ["Backend", "Capabilities", "Observer", "REGISTRY", "backend_class", "build_backend"]

# backend name -> "module:class"; each module has build(EngineConfig, RolloutConfig, HFModelConfig).
REGISTRY = {
    "local": "final.rollout.local:LocalRollout",
    "sglang": SGLANG_ROLLOUT,  # the lane's (final.compat)
    "tokasaurus": "final.rollout.tokasaurus:TokasaurusRollout",
}


def backend_class(name: str, source: str | None = None) -> type[Backend]:
    if name not in REGISTRY:
        raise ConfigError(f"unknown backend {name!r}; choose one of {', '.join(REGISTRY)}", key="rollout.name",
                          path=source)
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def build_backend(engine_config: Any, rollout_config: Any, model_config: Any) -> Backend:
    module = importlib.import_module(REGISTRY[engine_config.backend].split(":")[0])
    return module.build(engine_config, rollout_config, model_config)
