"""LocalRollout: veRL's BaseRollout on the embedded engine, same DataProto as SGLangRollout.

The batch path mirrors `SGLangRollout._batch_level_generate_sequences` (final/rollout/batch.py holds the shared
logic); requests are submitted one per row so each can carry its own seed and cartridges and so the caller can
watch progress, and the engine batches them continuously. With `multi_turn.enable` the request-level tool-calling
path runs instead (final/rollout/multi_turn.py).
"""

from __future__ import annotations

import asyncio
from typing import Callable, Generator

import torch
from verl.workers.rollout.base import BaseRollout

from final.engine import EmbeddedEngine
from final.rollout.batch import (assemble_batch, base_sampling_params, prompt_token_lists, request_sampling_params,
                                 row_cartridges)
from final.rollout.thread import run_until_complete


class LocalRollout(BaseRollout):
    def __init__(self, config, model_config, device_mesh=None, engine: EmbeddedEngine | None = None):
        super().__init__(config, model_config, device_mesh)
        self.processing_class = model_config.get_processor()
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        local = (config.engine_kwargs or {}).get("local") or {}
        self.engine = engine or EmbeddedEngine(
            model_config.local_path,
            dtype=config.dtype,
            device=local.get("device", "cpu"),
            max_running_requests=config.max_num_seqs,
            max_model_len=config.max_model_len or config.prompt_length + config.response_length,
            max_prefill_tokens=local.get("max_prefill_tokens", config.max_num_batched_tokens),
            mem_fraction_static=config.gpu_memory_utilization,
            random_seed=local.get("random_seed"),
        )
        self.sampling_params = base_sampling_params(config)
        self.on_request_done: Callable[[], None] | None = None  # progress hook, called once per finished row
        self.on_tool_event: Callable[[dict], None] | None = None  # multi-turn: assistant turns, tool calls/results
        self._multi_turn = None
        if config.multi_turn.enable:  # built now so a bad tools.yaml fails at start, not at the first request
            from final.rollout.multi_turn import MultiTurnRollout

            try:
                self._multi_turn = MultiTurnRollout(self.engine, config, self.processing_class)
            except BaseException:
                if engine is None:
                    self.engine.shutdown()
                raise
            self._multi_turn.on_event = self._multi_turn_event

    @property
    def multi_turn(self):
        """The multi-turn runner (final.rollout.multi_turn.MultiTurnRollout), None unless multi_turn.enable."""
        return self._multi_turn

    # ---- BaseRollout ---------------------------------------------------------------------------------
    @torch.no_grad()
    def generate_sequences(self, prompts, **kwargs):
        if self._multi_turn is not None:
            return self._multi_turn.generate_sequences(prompts, **kwargs)
        return self._batch_level_generate_sequences(prompts, **kwargs)

    async def resume(self, tags: list[str]) -> None:
        """The KV pool is rebuilt on demand after release(); weights never leave memory."""

    async def release(self) -> None:
        self.engine.release_memory_occupation()

    async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None], **kwargs) -> None:
        model = self.engine.model
        self.engine.call(lambda _runner: [model.load_hf_weight(name, tensor) for name, tensor in weights])
        self.engine.flush_cache()

    # ---- batch path ----------------------------------------------------------------------------------
    def _batch_level_generate_sequences(self, prompts, **kwargs):
        idx_list = prompt_token_lists(prompts, self.pad_token_id)
        params = request_sampling_params(self.sampling_params, self.config, prompts.meta_info, kwargs)
        seed = params.pop("seed", None)
        # Row i gets seed+i: reproducible, and rows repeated for n>1 still differ.
        row_params = [dict(params, seed=seed + i) if seed is not None else params for i in range(len(idx_list))]
        cartridges = row_cartridges(prompts) or [()] * len(idx_list)
        outputs = run_until_complete(self._all(idx_list, row_params, cartridges))
        self.engine.flush_cache()  # veRL flushes after every call; keep the same lifecycle
        # batch-sized tensor work belongs on the engine thread (one OpenMP team: see EmbeddedEngine.__init__)
        return self.engine.call(lambda _runner: assemble_batch(prompts, outputs, self.config, self.pad_token_id))

    async def _all(self, idx_list: list[list[int]], params: list[dict], cartridges: list[tuple[str, ...]]) -> list[dict]:
        tasks = [asyncio.ensure_future(self._one(ids, p, c)) for ids, p, c in zip(idx_list, params, cartridges)]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            # One bad row fails the call; abort the rows already running so the engine is left clean.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _one(self, ids: list[int], params: dict, cartridges: tuple[str, ...]) -> dict:
        out = await self.engine.async_generate(input_ids=ids, sampling_params=params, return_logprob=True,
                                               cartridges=cartridges or None)
        if self.on_request_done is not None:
            self.on_request_done()
        return out

    def _multi_turn_event(self, event: dict) -> None:
        if event["type"] == "done" and self.on_request_done is not None:
            self.on_request_done()
        if self.on_tool_event is not None:
            self.on_tool_event(event)

    def shutdown(self) -> None:
        self.engine.shutdown()


def build(engine_config, rollout_config, model_config) -> LocalRollout:
    return LocalRollout(rollout_config, model_config, None)
