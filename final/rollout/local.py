"""rollout.name: local — veRL's rollout contract on the embedded engine (final/engine/), in this process.

Same DataProto as SGLangRollout (final/rollout/engine_rollout.py has the paths); beyond it: per-row seeds,
cartridges held in the engine, token streams, tool events, weight updates (a trainer's LoRA adapter merged into
them: final/adapters/merge.py) and LoRA adapters served per row (final/engine/lora.py).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from final.adapters import LiveBase, MergedAdapter, load_adapter_folder, lora_keywords
from final.engine import EmbeddedEngine
from final.engine.engine import DEFAULT_PREFIX_CACHE_BYTES
from final.rollout.base import CONSTRAINED_KEYS, Capabilities, CartridgeTarget
from final.rollout.engine_rollout import EngineRollout
from final.weights import check_update


class LocalRollout(EngineRollout):
    name = "local"
    capabilities = Capabilities(cartridges=True, tools=True, call_tools=True, tool_events=True, streaming=True,
                                adapters=True, sampling_keys=CONSTRAINED_KEYS)
    # veRL flushes after every multi-turn call so no K/V of the old weights outlives an update; the embedded
    # engine's prefix cache is emptied by the update itself (and bounded by its budget), so a conversation that
    # goes on in the next call still finds its history
    flush_after_multi_turn = False

    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None, engine: EmbeddedEngine | None = None):
        local = (config.engine_kwargs or {}).get("local") or {}
        own = engine is None
        engine = engine or EmbeddedEngine(
            model_config.local_path,
            dtype=config.dtype,
            device=local.get("device", "cpu"),
            max_running_requests=config.max_num_seqs,
            max_model_len=config.max_model_len or config.prompt_length + config.response_length,
            max_prefill_tokens=local.get("max_prefill_tokens", config.max_num_batched_tokens),
            mem_fraction_static=config.gpu_memory_utilization,
            random_seed=local.get("random_seed"),
            quantization=local.get("quantization"),
            prefix_cache=local.get("prefix_cache", True),
            prefix_cache_bytes=local.get("prefix_cache_mb", DEFAULT_PREFIX_CACHE_BYTES >> 20) << 20,
        )
        super().__init__(config, model_config, engine, device_mesh, own_engine=own)
        self._merged: MergedAdapter | None = None

    @property
    def merged(self) -> MergedAdapter:
        """A trainer's adapter (veRL's LoRA) over the engine's live weights, made at the first update."""
        if self._merged is None:
            self._merged = MergedAdapter(LiveBase(self.engine.current_weights))
        return self._merged

    @property
    def cartridge_target(self) -> CartridgeTarget:
        return self.engine

    async def resume(self, tags: list[str]) -> None:
        """The KV pool is rebuilt on demand after release(); weights never leave memory."""

    async def release(self) -> None:
        self.engine.release_memory_occupation()

    async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], **kwargs: Any) -> None:
        """veRL's weight sync: HF-named tensors into every layout the engine keeps (fused q|k|v and gate|up, the
        kernel's arena, int8 blocks, bf16), checked whole first, written between steps once the running rows have
        finished (final/engine/weights.py, messages.Drain). LoRA tensors (veRL's peft_config / base_sync_done)
        are merged into their modules' kept bases first (final/adapters/merge.py)."""
        shapes = self.engine.parameter_shapes()
        plan = self.merged.plan(weights, shapes, **lora_keywords(kwargs))
        self.engine.update_weights(check_update(plan.named, shapes))
        plan.commit()

    def load_adapter(self, name: str, path: str) -> int:
        return self.engine.load_adapter(name, load_adapter_folder(path, self.engine.parameter_shapes()))

    def unload_adapter(self, name: str) -> bool:
        return self.engine.unload_adapter(name)

    def adapter_names(self) -> list[str]:
        return self.engine.adapter_names()


def build(engine_config: Any, rollout_config: Any, model_config: Any) -> LocalRollout:
    return LocalRollout(rollout_config, model_config)
