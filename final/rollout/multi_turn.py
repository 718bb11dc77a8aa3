"""Multi-turn tool-calling rollout: veRL 0.6.0's SGLangRollout request-level path, engine-agnostic.

`MultiTurnRollout(engine, config, tokenizer).generate_sequences(batch)` runs the state machine of
`SGLangRollout._async_rollout_a_request` (PENDING -> RUNNING -> TOOL_CALLING -> RUNNING ... -> COMPLETED) on veRL's
own `AsyncRolloutRequest` and `BaseTool` classes against any object speaking SGLang's `async_generate` dialect
(the embedded engine, or SGLang itself), and returns veRL's multi-turn DataProto (final/rollout/multi_turn_batch.py).

Where veRL behaves normally this produces exactly its tokens, masks and messages. Where veRL would crash or drop
the model's call silently, the problem is written into the conversation as a tool message and the loop goes on:
malformed call JSON, unknown tool, a tool raising or hanging (tools.yaml timeout_s), more calls than
`multi_turn.max_parallel_calls` (veRL's SGLangRollout ignores this key; its ToolAgentLoop drops the extra calls).
Tool output longer than `max_tool_response_length` is cut as ToolAgentLoop cuts it. `max_user_turns` bounds the
number of tool-response rounds (ToolAgentLoop's meaning; veRL's SGLangRollout only applies it to interactions).
With `rollout.multi_turn.constrain_tool_calls` (final's key, off by default) each assistant turn samples under
tool_choice "auto" with every tool strict (final.tools.constraint.calls_constraint): text is free, and any call the
policy starts is a call of one of its row's tools with arguments that validate, so no rollout holds a malformed call.
Per-row cartridges (`non_tensor_batch["cartridges"]`) are passed to `async_generate(cartridges=...)`. A call's own
tools (generate(tools=..., max_turns=N)) run here too: EngineRollout builds a MultiTurnRollout per such call with
its ToolSet, call format and full schemas (final/rollout/multi_turn_call.py), and chat template variables ride in
meta_info (final.outputs.TEMPLATE_KWARGS).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

import numpy as np
import torch
from verl import DataProto
from verl.tools.schemas import OpenAIFunctionCallSchema, OpenAIFunctionToolCall
from verl.workers.rollout.schemas import AsyncRolloutRequest, AsyncRolloutRequestStateEnum, FinishReasonTypeEnum

from final.compat import unserved_multi_turn
from final.config import multi_turn_option
from final.errors import PromptError, SamplingError, SequenceError, ToolConfigError
from final.outputs import ROW_INFO, TEMPLATE_KWARGS, TRACE_KEY
from final.prompts import object_array
from final.sampling import CONSTRAINT_KEYS, row_seed
from final.rollout.batch import (base_sampling_params, pad_token_id, request_sampling_params, row_cartridges,
                                 strip_left)
from final.rollout.multi_turn_batch import collate, padding_request
from final.rollout.multi_turn_call import FullToolSchema, call_messages, with_template_kwargs
from final.rollout.thread import gather_or_cancel, run_until_complete
from final.tools.constraint import calls_constraint
from final.tools.executor import ToolExecutor
from final.tools.parser import ParsedCall, ParseResult, ToolCallParser, check_format
from final.tools.registry import ToolSet, load_tools

logger = logging.getLogger(__name__)

State = AsyncRolloutRequestStateEnum
Finish = FinishReasonTypeEnum


@dataclass
class _Rollout:
    """One conversation: veRL's request, its cartridges, and what the loop keeps beside it."""

    req: AsyncRolloutRequest
    cartridges: Any = None
    trace: list[dict] = field(default_factory=list)  # tool calls and results, for people (TRACE_KEY)
    turns: int = 0
    tool_rounds: int = 0
    pending: list[ParsedCall] = field(default_factory=list)  # the last turn's calls, broken ones included
    info: dict = field(default_factory=lambda: {"finish_reason": None, "matched": None, "prompt_tokens": 0,
                                                "cached_tokens": 0, "completion_tokens": 0, "logprobs": None,
                                                "message": None})

    def record(self, meta: dict) -> None:
        """The engine's record (final.outputs.ROW_INFO): the first turn's prompt, the last turn's finish."""
        reason = meta.get("finish_reason") or {}
        if not self.turns:
            self.info.update(prompt_tokens=int(meta.get("prompt_tokens") or 0),
                             cached_tokens=int(meta.get("cached_tokens") or 0))
        self.info.update(finish_reason=reason.get("type"), matched=reason.get("matched"))


class MultiTurnRollout:
    def __init__(self, engine: Any, config: Any, processing_class: Any, tools: ToolSet | None = None,
                 fmt: str | None = None, max_assistant_turns: int | None = None, schemas: list[dict] | None = None,
                 flush_after_call: bool = True):
        """tools / fmt / max_assistant_turns / schemas: a call's own tools (generate(tools=..., max_turns=...)),
        their call format and full OpenAI schemas, instead of tools.yaml's and rollout.multi_turn's.
        flush_after_call: veRL's flush_cache when a call ends (EngineRollout.flush_after_multi_turn says)."""
        mt = config.multi_turn
        unserved = unserved_multi_turn(mt)
        if unserved:
            raise ToolConfigError("is not served by final's multi-turn rollout", key=f"rollout.multi_turn.{unserved}")
        _check_multi_turn(mt)
        self.engine = engine
        self.flush_after_call = flush_after_call  # veRL's flush_cache when a call ends (EngineRollout says)
        self.config = config
        self.processing_class = processing_class
        self.tokenizer = getattr(processing_class, "tokenizer", processing_class)
        self.tools = tools if tools is not None else load_tools(mt.tool_config_path) if mt.tool_config_path \
            else ToolSet()
        self.parser = ToolCallParser.for_tokenizer(fmt or mt.format, processing_class) if len(self.tools) else None
        # a call's own tools follow its tool_choice; tools.yaml's follow rollout.multi_turn.constrain_tool_calls
        self.constrain_calls = tools is None and mt.enable and multi_turn_option(mt, "constrain_tool_calls")
        if self.constrain_calls and self.parser is None:
            raise ToolConfigError("holds the calls of rollout.multi_turn.tool_config_path's tools to their schemas: "
                                  "configure tools", key="rollout.multi_turn.constrain_tool_calls")
        self._constraints: dict[tuple[str, ...], dict] = {}  # the row's tool names -> its sampling keys
        self.schemas = {s["function"]["name"]: s for s in schemas or []}  # a call's tools, rendered whole
        self.executor = ToolExecutor(self.tools, mt.max_parallel_calls, mt.max_tool_response_length,
                                     mt.tool_response_truncate_side)
        # SGLangRollout._verify_config's defaults, kept here: veRL writes them into the config, which may be shared
        self.max_model_len = config.get("max_model_len", None) or config.prompt_length + config.response_length
        self.max_assistant_turns = max_assistant_turns or mt.max_assistant_turns or self.max_model_len // 3
        self.max_user_turns = mt.max_user_turns or self.max_model_len // 3
        self.sampling_params = base_sampling_params(config)
        self.pad_token_id = pad_token_id(self.tokenizer)

    # ---- batch ---------------------------------------------------------------------------------------
    def generate_sequences(self, prompts: DataProto, *, observer: Any = None, **kwargs: Any) -> DataProto:
        """Blocking form, on the calling thread's event loop as veRL does (`loop.run_until_complete`)."""
        return run_until_complete(self.agenerate_sequences(prompts, observer=observer, **kwargs))

    async def agenerate_sequences(self, prompts: DataProto, *, observer: Any = None, **kwargs: Any) -> DataProto:
        """SGLangRollout._req_level_generate_sequences on this engine. `observer` (final.rollout.base.Observer)
        sees each assistant turn, tool call, tool result and finished row as it happens."""
        meta = prompts.meta_info
        call = _Call(request_sampling_params(self.sampling_params, self.config, meta, kwargs), observer,
                     with_template_kwargs(self.processing_class, meta.get(TEMPLATE_KWARGS)))
        rollouts = self._preprocess(prompts, call.pc)
        if meta.get("validate", False):
            done = await gather_or_cancel([self._rollout(r, call) for r in rollouts])  # a failed row stops the rest
        else:
            done = await self._rollout_with_over_sampling(rollouts, call)
        done = sorted(done, key=lambda r: (r.req.batch_data_id, r.req.rollout_offset))
        if self.flush_after_call:  # veRL's lifecycle (SGLang's is a coroutine, the embedded engine's not)
            flushed = self.engine.flush_cache()
            if inspect.isawaitable(flushed):
                await flushed
        out = collate([r.req for r in done], self.config, self.pad_token_id, prompts.batch["input_ids"].device,
                      self.tokenizer, self.max_model_len)
        if meta.get(TRACE_KEY):
            out.non_tensor_batch["tool_calls"] = object_array([r.trace for r in done])
        if meta.get(ROW_INFO):
            out.non_tensor_batch[ROW_INFO] = object_array([r.info for r in done])
        return out

    async def _rollout_with_over_sampling(self, rollouts: list[_Rollout], call: "_Call") -> list[_Rollout]:
        """veRL's training path: stop once (1 - over_sample_rate) of the requests finished; pad the rest.

        veRL then calls engine.abort_request(abort_all=True); cancelling a task already aborts its own engine
        request, and abort_all would also kill unrelated requests on a shared engine, so we do not."""
        target = int(len(rollouts) * (1 - self.config.get("over_sample_rate", 0.0)))

        async def guarded(r: _Rollout) -> _Rollout:
            try:
                return await self._rollout(r, call)
            except asyncio.CancelledError:
                return _Rollout(padding_request(r.req, self.config.response_length, self.pad_token_id))

        tasks = [asyncio.create_task(guarded(r)) for r in rollouts]
        try:
            completed = 0
            for fut in asyncio.as_completed(tasks):
                await fut
                completed += 1
                if completed >= target:
                    break
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return list(results)

    def _preprocess(self, prompts: DataProto, pc: Any) -> list[_Rollout]:
        """SGLangRollout._preprocess_prompt_to_async_rollout_requests, with typed errors for bad rows."""
        ntb = prompts.non_tensor_batch
        if "raw_prompt" not in ntb:
            raise PromptError("multi-turn rollout needs non_tensor_batch['raw_prompt'] (the chat messages)")
        if len(self.tools) and "tools_kwargs" not in ntb:
            raise PromptError("tools are configured: non_tensor_batch['tools_kwargs'] must give each row a dict "
                              "of tool name -> {create_kwargs, execute_kwargs, calc_reward_kwargs, release_kwargs}")
        cartridges = row_cartridges(prompts)
        out = []
        for i, raw_prompt in enumerate(ntb["raw_prompt"]):
            if not isinstance(raw_prompt, list | np.ndarray) or len(raw_prompt) == 0:
                raise PromptError("raw_prompt must be a non-empty list of messages", index=i)
            if len(self.tools):
                tools_kwargs = self._row_tools_kwargs(ntb["tools_kwargs"][i], i)
                schemas = self._schemas(tools_kwargs)
                input_ids = attention_mask = None
                if self.schemas:  # a call's own tools: rendered as a single-turn call renders them
                    raw_prompt = call_messages(self.tokenizer, list(raw_prompt), [self.schemas[k] for k in
                                                                                 tools_kwargs], self.parser.format)
            else:
                input_ids = strip_left(prompts.batch["input_ids"][i], self.pad_token_id)
                attention_mask = strip_left(prompts.batch["attention_mask"][i], 0)
                tools_kwargs, schemas = {}, None
            try:
                req = AsyncRolloutRequest(
                    batch_data_id=i, rollout_offset=0, request_id=str(uuid4()), state=State.PENDING,
                    messages=list(raw_prompt), multi_modal_data=None, tool_schemas=schemas,
                    tools_kwargs=tools_kwargs, interaction_kwargs={}, input_ids=input_ids, response_ids=None,
                    attention_mask=attention_mask, response_attention_mask=None, response_position_ids=None,
                    response_loss_mask=None, reward_scores={}, max_prompt_len=self.config.prompt_length,
                    max_response_len=self.config.response_length,
                    max_model_len=min(self.max_model_len,
                                      self.config.prompt_length + self.config.response_length),
                    use_inference_chat_template=self.config.multi_turn.use_inference_chat_template,
                    tokenization_sanity_check_mode=self.config.multi_turn.tokenization_sanity_check_mode,
                    processing_class=pc,
                )
            except (ValueError, TypeError) as exc:  # pydantic ValidationError is a ValueError
                raise PromptError(f"cannot build the conversation: {exc}", index=i) from exc
            out.append(_Rollout(req, cartridges[i] if cartridges is not None else None))
        return out

    def _schemas(self, names: Any) -> list:
        models = [self.tools[k].get_openai_tool_schema() for k in names]
        return [FullToolSchema.of(m, self.schemas[k]) if k in self.schemas else m for k, m in zip(names, models)]

    def _row_tools_kwargs(self, value: Any, index: int) -> dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise PromptError(f"tools_kwargs must be a dict of tool name -> kwargs, got {type(value).__name__}",
                              index=index)
        unknown = [k for k in value if k not in self.tools]
        if unknown:
            raise PromptError(f"tools_kwargs names unknown tools {unknown}; tools.yaml has {self.tools.names()}",
                              index=index)
        bad = [k for k, v in value.items() if not isinstance(v, dict)]
        if bad:
            raise PromptError(f"tools_kwargs[{bad[0]!r}] must be a dict (create_kwargs, execute_kwargs, ...)",
                              index=index)
        return value

    # ---- one request ---------------------------------------------------------------------------------
    async def _rollout(self, r: _Rollout, call: "_Call") -> _Rollout:
        """SGLangRollout._async_rollout_a_request: PENDING -> RUNNING <-> TOOL_CALLING -> COMPLETED."""
        run = _Rollout(deepcopy(r.req), r.cartridges)
        req = run.req
        finish: Finish | None = None
        while finish is None and run.turns < self.max_assistant_turns:
            if req.state == State.PENDING:
                await self._pending(req, call.pc)
            elif req.state == State.TOOL_CALLING:
                finish = await self._call_tools(run, call)
            elif req.state == State.RUNNING:
                finish = await self._assistant_turn(run, call)
        if finish is None or run.turns >= self.max_assistant_turns:  # veRL: out of turns is a stop
            finish = Finish.STOP
        rewards, errors = await self.executor.finish(req.request_id, req.tools_kwargs)
        run.trace.extend(errors)
        req.finalize(call.pc, {**rewards, "user_turn_rewards": []}, finish)
        if self.config.calculate_log_probs:
            await self._score(req, r.cartridges)
        run.info["completion_tokens"] = int(req.response_loss_mask.sum())
        call.emit("done", req, turns=run.turns)
        return run

    async def _pending(self, req: AsyncRolloutRequest, pc: Any) -> None:
        if req.tool_schemas is not None:
            names = [s.function.name for s in req.tool_schemas]
            created = await self.executor.create_all(req.request_id, names, req.tools_kwargs)
            req.add_tool_response_messages(pc, created)
        req.state = State.RUNNING

    async def _call_tools(self, run: _Rollout, call: "_Call") -> Finish | None:
        """Run the last assistant turn's calls; their results (or errors) become tool messages."""
        req = run.req
        if self.config.skip_tokenizer_init:
            req.messages[-1].tool_calls = None
        if run.tool_rounds >= self.max_user_turns:
            return Finish.STOP
        run.tool_rounds += 1
        assistant_index = len(req.messages) - 1
        for c in run.pending:
            call.emit("tool_call", req, turn=run.turns, name=c.name, arguments=c.arguments, error=c.error)
        outcomes = await self.executor.execute_turn(req.request_id, run.pending, req.tools_kwargs, run.turns)
        req.add_tool_response_messages(call.pc, [o.response for o in outcomes])
        for o in outcomes:
            run.trace.append({**o.trace, "message_index": assistant_index})
            call.emit("tool_result", req, **o.trace)
            if o.executed:
                req.update_metrics(o.metrics, o.trace["name"])
        if req.input_ids.shape[-1] >= self.max_model_len:
            return Finish.STOP
        req.state = State.RUNNING
        return None

    async def _assistant_turn(self, run: _Rollout, call: "_Call") -> Finish | None:
        """Generate one assistant turn; parse its tool calls (veRL keeps only valid ones, we keep all)."""
        req, pc = run.req, call.pc
        ids = req.get_generation_prompt_ids(pc)
        if len(ids) + 1 >= self.max_model_len:
            return Finish.LENGTH
        output = await self._generate(ids, self._turn_params(req, call), run.cartridges)
        run.record(output["meta_info"])
        content = self.tokenizer.decode(output["output_ids"], skip_special_tokens=True)
        content_ids = torch.tensor(output["output_ids"], dtype=req.input_ids.dtype).unsqueeze(0)
        finish = _finish_reason(output)
        run.turns += 1
        call.emit("assistant", req, turn=run.turns, text=content)
        parsed = self._parse(content) if finish != Finish.LENGTH else None
        run.pending = parsed.calls if parsed else []
        runnable = [c for c in run.pending if c.ok and c.name in self.tools]
        if runnable:  # veRL re-renders the turn from the template with the parsed calls
            calls = [OpenAIFunctionToolCall(id="-1", function=OpenAIFunctionCallSchema(
                name=c.name, arguments=c.arguments)) for c in runnable]  # id: SGLang's tool_index -1
            req.add_assistant_message(pc, content=parsed.normal_text, tool_calls=calls)
        else:  # plain text, or only broken calls: keep the model's own tokens so it sees what it wrote
            req.add_assistant_message(pc, content=content, content_ids=content_ids)
        if run.pending:
            req.state = State.TOOL_CALLING
            return None
        if finish != Finish.LENGTH:
            req.state = State.COMPLETED
        return finish

    def _turn_params(self, req: AsyncRolloutRequest, call: "_Call") -> dict:
        """The row's sampling params, with its tools' call constraint under constrain_tool_calls."""
        params = call.row_params(req.batch_data_id)
        if not self.constrain_calls or not req.tool_schemas:
            return params
        given = [k for k in CONSTRAINT_KEYS if params.get(k) is not None]
        if given:
            raise SamplingError("rollout.multi_turn.constrain_tool_calls already holds each turn to the row's tool "
                                "calls: a call takes one constraint", given[0])
        names = tuple(s.function.name for s in req.tool_schemas)
        if names not in self._constraints:  # each tool's schema as tools.yaml wrote it (veRL's model drops keywords)
            tools = [self.tools.written.get(s.function.name) or s.model_dump(exclude_none=True)
                     for s in req.tool_schemas]
            self._constraints[names] = calls_constraint(self.parser.format, tools,
                                                        self.executor.max_parallel_calls > 1)
        return {**params, **self._constraints[names]}

    def _parse(self, content: str) -> ParseResult | None:
        if self.parser is None or not self.parser.has_tool_call(content):
            return None
        return self.parser.parse(content)

    async def _generate(self, ids: list[int], params: dict, cartridges: Any) -> dict:
        """SGLangRollout._handle_engine_generate (+ the request's cartridges)."""
        kw = params.copy()
        kw["max_new_tokens"] = min(self.config.response_length, self.max_model_len - len(ids) - 1)
        kw["n"] = 1
        return_logprob = kw.pop("logprobs", False)
        extra = {"cartridges": cartridges} if cartridges else {}
        return await self.engine.async_generate(input_ids=ids, sampling_params=kw, return_logprob=return_logprob,
                                                image_data=None, **extra)

    async def _score(self, req: AsyncRolloutRequest, cartridges: Any) -> None:
        """calculate_log_probs: veRL scores the finished sequence with a zero-token generate (behind the same
        cartridges as its turns, so the logprobs are the ones the model sampled with)."""
        params = {**self.sampling_params, "max_new_tokens": 0}
        extra = {"cartridges": cartridges} if cartridges else {}
        out = await self.engine.async_generate(input_ids=req.input_ids.squeeze(0).tolist(), sampling_params=params,
                                               return_logprob=True, logprob_start_len=0, **extra)
        pairs = [(lp, tok) for lp, tok, _ in out["meta_info"]["input_token_logprobs"][1:]]
        req.rollout_log_probs = torch.tensor([lp for lp, _ in pairs])
        req.output_token_ids = torch.tensor([tok for _, tok in pairs])


@dataclass
class _Call:
    """One generate_sequences call: its sampling params and observer."""

    params: dict
    observer: Any = None
    pc: Any = None  # the processing class this call renders with (its chat template variables)

    def row_params(self, row: int) -> dict:
        """Row i of the call samples with seed + i (final.sampling.row_seed), as on the batch path."""
        seed = self.params.get("seed")
        return self.params if seed is None else {**self.params, "seed": row_seed(seed, row)}

    def emit(self, kind: str, req: AsyncRolloutRequest, **fields: Any) -> None:
        if self.observer is None:
            return
        try:
            if kind == "done":
                self.observer.row_done()
            self.observer.tool_event({"type": kind, "row": req.batch_data_id, "request_id": req.request_id,
                                      **fields})
        except Exception:  # noqa: BLE001 - a display callback must not break the rollout
            logger.exception("multi-turn observer failed")


def _check_multi_turn(mt: Any) -> None:
    def positive_int(name: str, allow_none: bool = False) -> None:
        value = getattr(mt, name)
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ToolConfigError(f"must be a positive integer, got {value!r}", key=f"rollout.multi_turn.{name}")

    positive_int("max_parallel_calls")
    positive_int("max_tool_response_length")
    positive_int("max_assistant_turns", allow_none=True)
    positive_int("max_user_turns", allow_none=True)
    if mt.tool_response_truncate_side not in ("left", "right", "middle"):
        raise ToolConfigError(f"must be left, right or middle, got {mt.tool_response_truncate_side!r}",
                              key="rollout.multi_turn.tool_response_truncate_side")
    if mt.format is not None:
        check_format(mt.format)


def _finish_reason(output: dict) -> Finish:
    reason = output["meta_info"]["finish_reason"]
    kind = reason["type"]
    if kind == "abort":  # the conversation has no answer for this turn: the call fails with the engine's cause
        raise SequenceError(f"request {output['meta_info'].get('id')}: {reason.get('message') or 'aborted'}")
    return Finish.from_str(kind)
