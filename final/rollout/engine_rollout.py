"""EngineRollout: veRL's rollout contract over any engine that speaks final's engine dialect.

The dialect is SGLang 0.5.2's `async_generate` (final/engine/engine.py) plus `submit_generate`, its batch form
for callers without an event loop. The embedded engine speaks it in-process (final/rollout/local.py) and
final/rollout/tokasaurus.py speaks it over HTTP, so both backends share this one rollout:
- the batch path (`SGLangRollout._batch_level_generate_sequences`): one submission of every row, each with
  its own seed and cartridges; the engine runs `assemble_batch` over the outputs on its own thread, so the
  call crosses threads twice (rows in, DataProto out);
- the multi-turn tool-calling path (final/rollout/multi_turn.py) when multi_turn.enable, and for a call that runs
  its own tools (final.outputs.CALL_TOOLS); a call that only offers tools takes the batch path (SINGLE_TURN);
- `astream`: per-token updates of every row, merged in arrival order, where the engine can stream.
A call whose meta_info asks for prompt logprobs / top-k alternatives (final.outputs.PROMPT_LOGPROBS, TOP_LOGPROBS)
passes the engine SGLang's logprob_start_len=0 / top_logprobs_num, and always takes the batch path (scoring).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import torch

from final.errors import ToolConfigError, UnsupportedError
from final.outputs import CALL_TOOLS, Completion
from final.rollout.base import Backend, Observer, check_constrained_calls
from final.rollout.batch import (assemble_batch, base_sampling_params, logprob_request, pad_token_id, plan_rows,
                                 single_turn)
from final.rollout.multi_turn import MultiTurnRollout


class EngineRollout(Backend):
    # veRL's request-level lifecycle flushes the engine's cache when a multi-turn call ends (SGLangRollout: the
    # weights may change next); an engine whose cache a weight update empties itself keeps it instead
    flush_after_multi_turn = True

    def __init__(self, config: Any, model_config: Any, engine: Any, device_mesh: Any = None, own_engine: bool = True):
        """own_engine: the rollout stops the engine on shutdown, and at once if this constructor fails."""
        super().__init__(config, model_config, device_mesh)
        self.engine = engine
        self._own_engine = own_engine
        try:
            self._setup(config, model_config)
        except BaseException:
            if own_engine:
                engine.shutdown()
            raise

    def _setup(self, config: Any, model_config: Any) -> None:
        self.processing_class = model_config.get_processor()
        self.tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        self.pad_token_id = pad_token_id(self.tokenizer)
        self.sampling_params = base_sampling_params(config)
        self.multi_turn = None
        check_constrained_calls(self.name, self.capabilities, config)
        if config.multi_turn.enable:  # built now so a bad tools.yaml fails at start, not at the first request
            if config.calculate_log_probs and not self.capabilities.prompt_logprobs:
                raise ToolConfigError(f"multi-turn with calculate_log_probs scores each conversation's tokens, "
                                      f"which the {self.name} backend cannot (no prompt logprobs)",
                                      key="rollout.calculate_log_probs")
            self.multi_turn = MultiTurnRollout(self.engine, config, self.processing_class,
                                               flush_after_call=self.flush_after_multi_turn)

    # ---- Backend ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate_sequences(self, prompts: Any, *, observer: Observer | None = None, **kwargs: Any) -> Any:
        loop = self._loop_for(prompts)
        if loop is not None:
            return loop.generate_sequences(prompts, observer=observer, **kwargs)
        return self._submit(prompts, observer, kwargs).result()

    async def agenerate_sequences(self, prompts: Any, *, observer: Observer | None = None, **kwargs: Any) -> Any:
        loop = self._loop_for(prompts)
        if loop is not None:
            return await loop.agenerate_sequences(prompts, observer=observer, **kwargs)
        return await self._submit(prompts, observer, kwargs).wait()

    def _loop_for(self, prompts: Any) -> Any:
        """The multi-turn loop a call runs in: its own tools' (final.outputs.CALL_TOOLS: generate(tools=...,
        max_turns=...)), none (scoring, tools only offered), or tools.yaml's."""
        call = prompts.meta_info.get(CALL_TOOLS)
        if call is not None:
            if self.config.calculate_log_probs and not self.capabilities.prompt_logprobs:
                raise UnsupportedError(self.name, "max_turns", "the multi-turn loop with rollout.calculate_log_probs "
                                       "scores each conversation's tokens, which this backend cannot")
            return MultiTurnRollout(self.engine, self.config, self.processing_class, tools=call["tools"],
                                    fmt=call["format"], max_assistant_turns=call["max_turns"],
                                    schemas=call["schemas"], flush_after_call=self.flush_after_multi_turn)
        return None if single_turn(prompts) else self.multi_turn

    async def astream(self, prompts: Any, **kwargs: Any) -> AsyncIterator[Completion]:
        if not self.capabilities.streaming or self._loop_for(prompts) is not None:
            async for row in super().astream(prompts, **kwargs):
                yield row
            return
        rows = plan_rows(prompts, self.sampling_params, self.config, kwargs, self.pad_token_id)
        streams, merged = [], None
        try:  # every stream is opened (its request validated) before the first update is awaited
            for i, (ids, params) in enumerate(zip(rows.ids, rows.params)):
                carts = rows.cartridges[i] if rows.cartridges else None
                extra = {"adapters": rows.adapters[i]} if rows.adapters and rows.adapters[i] else {}
                streams.append(await self.engine.async_generate(input_ids=ids, sampling_params=params,
                                                                return_logprob=True, cartridges=carts or None,
                                                                stream=True, **extra, **logprob_request(prompts)))
            merged = merge_streams(streams)
            async for index, out in merged:
                yield Completion.from_engine(index, out)
        finally:
            # Closed (or cancelled) at the yield above, the merge's pumps are still reading the streams, and a
            # stream being read cannot be closed ("asynchronous generator is already running"): stop them first.
            if merged is not None:
                await merged.aclose()
            for s in streams:
                await s.aclose()

    def tool_schemas(self) -> list[dict]:
        return self.multi_turn.tools.schemas() if self.multi_turn is not None else []

    def shutdown(self) -> None:
        if self._own_engine:
            self.engine.shutdown()

    # ---- the batch path --------------------------------------------------------------------------------
    def _submit(self, prompts: Any, observer: Observer | None, kwargs: dict) -> Any:
        if "n" in kwargs and kwargs["n"] != 1:
            raise UnsupportedError(self.name, "n", "must be 1 per row: veRL repeats a prompt's rows for n > 1")
        rows = plan_rows(prompts, self.sampling_params, self.config, kwargs, self.pad_token_id)
        extra = {"adapters": rows.adapters} if rows.adapters else {}  # only engines serving adapters get them
        return self.engine.submit_generate(
            rows.ids, rows.params, return_logprob=True, cartridges=rows.cartridges, **extra, **logprob_request(prompts),
            finish=lambda outputs: assemble_batch(prompts, outputs, self.config, self.pad_token_id),
            on_row=(lambda _row, _out: observer.row_done()) if observer is not None else None)


async def merge_streams(streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """(stream index, update) from several engine streams, in arrival order; closing this closes them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[dict]) -> None:
        try:
            async for out in stream:
                await queue.put((index, out))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(tasks)):
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
