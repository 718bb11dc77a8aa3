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
Per-row cartridges (`non_tensor_batch["cartridges"]`) are passed to `async_generate(cartridges=...)`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any, Callable
from uuid import uuid4

import numpy as np
import torch
from verl import DataProto
from verl.tools.schemas import OpenAIFunctionCallSchema, OpenAIFunctionToolCall
from verl.workers.rollout.schemas import AsyncRolloutRequest, AsyncRolloutRequestStateEnum, FinishReasonTypeEnum

from final.errors import EngineError, PromptError, ToolConfigError
from final.rollout.batch import base_sampling_params, request_sampling_params, row_cartridges
from final.rollout.multi_turn_batch import collate, padding_request
from final.rollout.thread import run_until_complete
from final.tools.executor import ToolExecutor
from final.tools.parser import ParsedCall, ParseResult, ToolCallParser
from final.tools.registry import ToolSet, load_tools

logger = logging.getLogger(__name__)

State = AsyncRolloutRequestStateEnum
Finish = FinishReasonTypeEnum
TRACE_KEY = "final_tool_trace"  # meta_info flag: add non_tensor_batch["tool_calls"] (per-row call records)


@dataclass
class _Rollout:
    req: AsyncRolloutRequest
    cartridges: Any = None
    trace: list[dict] = field(default_factory=list)


class MultiTurnRollout:
    def __init__(self, engine: Any, config: Any, processing_class: Any, tools: ToolSet | None = None):
        mt = config.multi_turn
        if mt.interaction_config_path:
            raise ToolConfigError("interactions are not supported by the local multi-turn rollout",
                                  key="rollout.multi_turn.interaction_config_path")
        _check_multi_turn(mt)
        self.engine = engine
        self.config = config
        self.processing_class = processing_class
        self.tokenizer = getattr(processing_class, "tokenizer", processing_class)
        self.tools = tools if tools is not None else load_tools(mt.tool_config_path) if mt.tool_config_path \
            else ToolSet()
        self.parser = ToolCallParser.for_tokenizer(mt.format, processing_class) if len(self.tools) else None
        self.executor = ToolExecutor(self.tools, mt.max_parallel_calls, mt.max_tool_response_length,
                                     mt.tool_response_truncate_side)
        # SGLangRollout._verify_config's defaults (it mutates the config the same way)
        if not config.get("max_model_len", None):
            config.max_model_len = config.prompt_length + config.response_length
        if mt.max_assistant_turns is None:
            mt.max_assistant_turns = config.max_model_len // 3
        if mt.max_user_turns is None:
            mt.max_user_turns = config.max_model_len // 3
        self.sampling_params = base_sampling_params(config)
        # on_event(dict) sees each assistant turn, tool call, tool result and finished row as it happens
        self.on_event: Callable[[dict], None] | None = None
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            raise ToolConfigError("the tokenizer has no pad token", key="model_path")

    # ---- batch ---------------------------------------------------------------------------------------
    def generate_sequences(self, prompts: DataProto, **kwargs: Any) -> DataProto:
        """Blocking form, on the calling thread's event loop as veRL does (`loop.run_until_complete`)."""
        return run_until_complete(self.agenerate_sequences(prompts, **kwargs))

    async def agenerate_sequences(self, prompts: DataProto, **kwargs: Any) -> DataProto:
        """SGLangRollout._req_level_generate_sequences on this engine."""
        do_sample = prompts.meta_info.get("do_sample", True)
        is_validate = prompts.meta_info.get("validate", False)
        rollouts = self._preprocess(prompts)
        if is_validate:
            done = await asyncio.gather(*(self._rollout(r, do_sample, is_validate, **kwargs) for r in rollouts))
        else:
            done = await self._rollout_with_over_sampling(rollouts, do_sample, is_validate, **kwargs)
        done = sorted(done, key=lambda r: (r.req.batch_data_id, r.req.rollout_offset))
        await _maybe_await(self.engine.flush_cache())
        reqs = [r.req for r in done]
        device = prompts.batch["input_ids"].device
        # batch-sized tensor work belongs on the engine thread (one OpenMP team: see EmbeddedEngine.__init__)
        call = getattr(self.engine, "call", None)
        make = lambda _runner=None: collate(reqs, self.config, self.pad_token_id, device, self.tokenizer)  # noqa: E731
        out = call(make) if call is not None else make()
        if prompts.meta_info.get(TRACE_KEY):
            out.non_tensor_batch["tool_calls"] = _object_array([r.trace for r in done])
        return out

    async def _rollout_with_over_sampling(self, rollouts: list[_Rollout], do_sample: bool, is_validate: bool,
                                          **kwargs: Any) -> list[_Rollout]:
        """veRL's training path: stop once (1 - over_sample_rate) of the requests finished; pad the rest.

        veRL then calls engine.abort_request(abort_all=True); cancelling a task already aborts its own engine
        request, and abort_all would also kill unrelated requests on a shared engine, so we do not."""
        target = int(len(rollouts) * (1 - self.config.get("over_sample_rate", 0.0)))

        async def guarded(r: _Rollout) -> _Rollout:
            try:
                return await self._rollout(r, do_sample, is_validate, **kwargs)
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

    def _preprocess(self, prompts: DataProto) -> list[_Rollout]:
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
                schemas = [self.tools[k].get_openai_tool_schema() for k in tools_kwargs]
                input_ids = attention_mask = None
            else:
                input_ids = _strip_left(self.pad_token_id, prompts.batch["input_ids"][i])
                attention_mask = _strip_left(0, prompts.batch["attention_mask"][i])
                tools_kwargs, schemas = {}, None
            try:
                req = AsyncRolloutRequest(
                    batch_data_id=i, rollout_offset=0, request_id=str(uuid4()), state=State.PENDING,
                    messages=list(raw_prompt), multi_modal_data=None, tool_schemas=schemas,
                    tools_kwargs=tools_kwargs, interaction_kwargs={}, input_ids=input_ids, response_ids=None,
                    attention_mask=attention_mask, response_attention_mask=None, response_position_ids=None,
                    response_loss_mask=None, reward_scores={}, max_prompt_len=self.config.prompt_length,
                    max_response_len=self.config.response_length,
                    max_model_len=min(self.config.max_model_len,
                                      self.config.prompt_length + self.config.response_length),
                    use_inference_chat_template=self.config.multi_turn.use_inference_chat_template,
                    tokenization_sanity_check_mode=self.config.multi_turn.tokenization_sanity_check_mode,
                    processing_class=self.processing_class,
                )
            except (ValueError, TypeError) as exc:  # pydantic ValidationError is a ValueError
                raise PromptError(f"cannot build the conversation: {exc}", index=i) from exc
            out.append(_Rollout(req, cartridges[i] if cartridges is not None else None))
        return out

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
    async def _rollout(self, r: _Rollout, do_sample: bool, is_validate: bool, **kwargs: Any) -> _Rollout:
        """SGLangRollout._async_rollout_a_request."""
        req, pc, mt = deepcopy(r.req), self.processing_class, self.config.multi_turn
        run = _Rollout(req, r.cartridges)
        params = request_sampling_params(self.sampling_params, self.config,
                                         {"do_sample": do_sample, "validate": is_validate}, kwargs)
        finish: Finish | None = None
        turns = tool_rounds = 0
        pending: list[ParsedCall] = []  # this turn's calls, broken ones included (veRL keeps only valid ones)
        while turns < mt.max_assistant_turns:
            if req.state == State.PENDING:
                if req.tool_schemas is not None:
                    names = [s.function.name for s in req.tool_schemas]
                    req.add_tool_response_messages(pc, await self.executor.create_all(req.request_id, names,
                                                                                      req.tools_kwargs))
                req.state = State.RUNNING
            elif req.state == State.TOOL_CALLING:
                if self.config.skip_tokenizer_init:
                    req.messages[-1].tool_calls = None
                if tool_rounds >= mt.max_user_turns:
                    finish = Finish.STOP
                    break
                tool_rounds += 1
                assistant_index = len(req.messages) - 1
                for c in pending:
                    self._emit("tool_call", req, turn=turns, name=c.name, arguments=c.arguments, error=c.error)
                outcomes = await self.executor.execute_turn(req.request_id, pending, req.tools_kwargs, turns)
                req.add_tool_response_messages(pc, [o.response for o in outcomes])
                for o in outcomes:
                    run.trace.append({**o.trace, "message_index": assistant_index})
                    self._emit("tool_result", req, **o.trace)
                    if o.executed:
                        req.update_metrics(o.metrics, o.trace["name"])
                if req.input_ids.shape[-1] >= self.config.max_model_len:
                    finish = Finish.STOP
                    break
                req.state = State.RUNNING
            elif req.state == State.RUNNING:
                ids = req.get_generation_prompt_ids(pc)
                if len(ids) + 1 >= self.config.max_model_len:
                    finish = Finish.LENGTH
                    break
                output = await self._generate(ids, params, r.cartridges)
                content_ids = output["output_ids"]
                content = self.tokenizer.decode(content_ids, skip_special_tokens=True)
                content_ids = torch.tensor(content_ids, dtype=req.input_ids.dtype).unsqueeze(0)
                finish = _finish_reason(output)
                turns += 1
                self._emit("assistant", req, turn=turns, text=content)
                if finish == Finish.LENGTH:
                    req.add_assistant_message(pc, content=content, content_ids=content_ids)
                    break
                parsed = self._parse(content)
                pending = parsed.calls if parsed else []
                if pending:
                    finish, req.state = Finish.TOOL_CALL, State.TOOL_CALLING
                    runnable = [c for c in pending if c.ok and c.name in self.tools]
                    if runnable:  # veRL re-renders the turn from the template with the parsed calls
                        calls = [OpenAIFunctionToolCall(id="-1", function=OpenAIFunctionCallSchema(
                            name=c.name, arguments=c.arguments)) for c in runnable]  # id: SGLang's tool_index -1
                        req.add_assistant_message(pc, content=parsed.normal_text, tool_calls=calls)
                    else:  # only broken calls: keep the model's own tokens so it sees what it wrote
                        req.add_assistant_message(pc, content=content, content_ids=content_ids)
                else:
                    req.add_assistant_message(pc, content=content, content_ids=content_ids)
                    finish, req.state = Finish.STOP, State.COMPLETED
                    break
        if turns >= mt.max_assistant_turns:
            finish = Finish.STOP
        rewards, errors = await self.executor.finish(req.request_id, req.tools_kwargs)
        run.trace.extend(errors)
        req.finalize(pc, {**rewards, "user_turn_rewards": []}, finish)
        if self.config.calculate_log_probs:
            await self._score(req, r.cartridges)
        self._emit("done", req, turns=turns)
        return run

    def _emit(self, kind: str, req: AsyncRolloutRequest, **fields: Any) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event({"type": kind, "row": req.batch_data_id, "request_id": req.request_id, **fields})
        except Exception:  # noqa: BLE001 - a display callback must not break the rollout
            logger.exception("multi-turn on_event callback failed")

    def _parse(self, content: str) -> ParseResult | None:
        if self.parser is None or not self.parser.has_tool_call(content):
            return None
        return self.parser.parse(content)

    async def _generate(self, ids: list[int], params: dict, cartridges: Any) -> dict:
        """SGLangRollout._handle_engine_generate (+ the request's cartridges)."""
        kw = params.copy()
        kw["max_new_tokens"] = min(self.config.response_length, self.config.max_model_len - len(ids) - 1)
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
    if mt.format not in (None, "auto", "hermes", "qwen25"):
        raise ToolConfigError(f"unsupported tool-call format {mt.format!r}; choose hermes, qwen25 or auto",
                              key="rollout.multi_turn.format")


def _finish_reason(output: dict) -> Finish:
    kind = output["meta_info"]["finish_reason"]["type"]
    if kind == "abort":
        raise EngineError(f"the engine aborted request {output['meta_info'].get('id')}")
    return Finish.from_str(kind)


def _strip_left(pad: int, ids: torch.Tensor) -> torch.Tensor:
    """veRL's _pre_process_inputs: drop the left padding of one row."""
    return ids[torch.nonzero(ids != pad, as_tuple=False)[0][0]:]


def _object_array(items: list) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    return arr


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value
