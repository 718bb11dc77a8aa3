"""rollout.name: sglang on the verl09 lane — SGLang's own Engine (sglang 0.5.12, veRL 0.9.1's pin), in-process.

Why not veRL 0.9's SGLang classes: veRL 0.9.1 removed the in-process SGLangRollout. Its SGLang path is
`SGLangHttpServer`, a Ray actor that launches SGLang's HTTP server on the node's address, and `ServerAdapter`, the
trainer-side weight sync. For one engine in the caller's process, that adds Ray, a socket and an HTTP hop. final
uses none of it. So this backend drives `sglang.Engine` directly (engine_0512.py speaks final's engine dialect over
it) under EngineRollout. It gets the same batch path, multi-turn tool calling, token streams and DataProto as the
local and tokasaurus backends (final/rollout/engine_rollout.py).

What it shares with the verl06 lane's backend (rollout_052.py, in this folder):
- the requirements, the ServerArgs translation and checks (config.py);
- the process handling (procs.py): the engine's own children only, and SIGQUIT survival;
- the event-loop policy SGLang swaps for uvloop's is restored;
- cartridges: reserved ids (cartridges.py) whose KV the scheduler child injects into the radix cache, re-injected
  after a flush (scheduler.py, which speaks both releases' radix-cache APIs).

What differs:
- Per-row seeds: SGLang 0.5.12 has `sampling_seed`, but reads it only under `enable_deterministic_inference`
  (which needs the fa3, flashinfer or triton attention backend, i.e. a GPU, and samples with the pytorch backend);
  without it `seed` is refused, not silently ignored. With it an unseeded row samples with seed 42 (SGLang's
  default), and flashinfer attention turns the radix cache off, which cartridges need: use fa3 or triton.
- SGLang loads its tokenizer (skip_tokenizer_init false in its ServerArgs). Stop strings are then SGLang's own;
  prompts and outputs are still token ids.
- Token streams are SGLang's own (`stream=True`), bridged from the engine's loop to the caller's.
- veRL does not drive this engine, so a batch call (generate, score) leaves the radix cache as it is (veRL 0.6.0
  flushes after every generate_sequences); a multi-turn call flushes once at its end (final/rollout/multi_turn.py,
  veRL's request-level lifecycle, awaited without blocking the caller's loop), and so does a weight update. An
  unloaded cartridge's slots are freed when the pool needs room, or by the next flush.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - its exit hook, before SGLang disables threading._register_atexit
import dataclasses
import importlib.util
import logging
from typing import Any

import torch

from final.adapters import FolderBase, MergedAdapter, lora_keywords
from final.rollout.base import CONSTRAINED_KEYS, Capabilities
from final.rollout.engine_rollout import EngineRollout
from final.rollout.sglang.cartridges import ModelDims, SGLangCartridges
from final.rollout.sglang.config import (check_applied_defaults, preflight, refusing, require_sglang, sglang_device,
                                        translate_config, unserved_keys)
from final.rollout.sglang.engine_0512 import NO_SEED, DirectSGLangEngine
from final.rollout.sglang.procs import survive_sigquit
from final.rollout.sglang.weights import contiguous, share_tensors_safely
from final.weights import check_update, hf_parameter_shapes


logger = logging.getLogger(__name__)

GRPC_PORT_LIMIT = 65535 - 10000  # ServerArgs refuses a port whose port + 10000 (its gRPC port) exceeds 65535


def server_args(config: Any, device: str) -> dict:
    """SGLang 0.5.12 ServerArgs: final's translation (checks, ports, engine_kwargs.sglang), plus what veRL 0.6.0's
    rollout set itself, plus the CPU device's needs (no CUDA graphs of either kind)."""
    capability = None if device == "cpu" else tuple(torch.cuda.get_device_capability())
    have_flashinfer = importlib.util.find_spec("flashinfer") is not None
    gpus = 1 if device == "cpu" else torch.cuda.device_count()
    config, extra = translate_config(config, capability, have_flashinfer, gpus, port_below=GRPC_PORT_LIMIT)
    backend = config.engine_kwargs["sglang"]["attention_backend"]
    args = {"dtype": config.dtype, "mem_fraction_static": config.gpu_memory_utilization, "tp_size": 1,
            "load_format": config.load_format, "max_running_requests": config.max_num_seqs,
            "attention_backend": backend, "skip_tokenizer_init": False, "log_level": "warning",
            # constraints (json_schema, regex, ebnf, structural_tag) compile with the embedded engine's compiler,
            # registered in the scheduler child (scheduler.py, grammar_backend.py): one behaviour on both backends
            "grammar_backend": "final", **extra}
    if device == "cpu":
        args.setdefault("disable_cuda_graph", True)
        args.setdefault("disable_piecewise_cuda_graph", True)
    return args


class DirectSGLangRollout(EngineRollout):
    name = "sglang"
    capabilities = Capabilities(cartridges=True, tools=True, call_tools=True, tool_events=True, streaming=True,
                                sampling_keys=CONSTRAINED_KEYS, notes=(
        ("adapter", "not served per request on this lane yet: serve an adapter merged (update_weights with the "
                    "adapter) or on the local backend"),))

    @classmethod
    def preflight(cls, engine_config: Any) -> None:
        check_applied_defaults(engine_config.rollout, unserved_keys(engine_config.rollout.get("engine_kwargs")),
                               engine_config.source)
        preflight(engine_config)

    def __init__(self, config: Any, model_config: Any):
        device = sglang_device(config.engine_kwargs)
        require_sglang(device)
        survive_sigquit()  # SGLang's watchdog SIGQUITs this process when a child dies (main thread only: else no-op)
        args = server_args(config, device)
        self.capabilities = refusing(self.capabilities, unserved_keys(config.engine_kwargs))
        if not args.get("enable_deterministic_inference"):
            # SGLang 0.5.12 reads a request's sampling_seed only under deterministic inference (sampling_batch_info
            # builds the seeds only then): without it a seed would be silently ignored, so it is refused instead
            self.capabilities = dataclasses.replace(self.capabilities, seed=False,
                                                    notes=self.capabilities.notes + (("seed", NO_SEED),))
        self._device = device
        engine = DirectSGLangEngine(model_config.local_path, args, model_config.hf_config.vocab_size)
        self.merged = MergedAdapter(FolderBase(model_config.local_path))  # a trainer's adapter, as merged weights
        super().__init__(config, model_config, engine)
        # the reserved ids come from the tokenizer EngineRollout loaded (ids past it first, never a special id)
        engine.cartridges = SGLangCartridges(engine, ModelDims.of(model_config.hf_config), len(self.tokenizer),
                                             self.tokenizer.all_special_ids)

    @property
    def cartridge_target(self) -> SGLangCartridges:
        """What CartridgeService drives: load_cartridge / unload_cartridge into the scheduler's radix cache."""
        return self.engine.cartridges

    def cartridge_memory(self) -> dict:
        """Where the scheduler keeps cartridge KV (see SGLangCartridges.memory): host copies, pool slots."""
        return self.engine.cartridges.memory()

    async def resume(self, tags: list[str]) -> None:
        """SGLang keeps its KV pool and weights; nothing was released."""

    async def release(self) -> None:
        """Nothing is released on this lane (no memory saver): the engine keeps serving."""

    async def update_weights(self, weights: Any, **kwargs: Any) -> None:
        """HF-named tensors, checked whole against the model's parameters, into SGLang's update_weights_from_tensor;
        then the radix cache is flushed (cartridges injected again). LoRA tensors are merged into their modules'
        bases first (final/adapters/merge.py)."""
        shapes = hf_parameter_shapes(self.model_config.local_path)
        plan = self.merged.plan(weights, shapes, **lora_keywords(kwargs))
        named = check_update(plan.named, shapes)
        share_tensors_safely()
        self.engine.update_weights(contiguous(named, self._device))
        plan.commit()


def build(engine_config: Any, rollout_config: Any, model_config: Any) -> DirectSGLangRollout:
    return DirectSGLangRollout(rollout_config, model_config)
