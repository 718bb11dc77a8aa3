"""Mirrors sglang/srt/managers/tokenizer_manager.py (+ tokenizer_communicator_mixin.py) of 0.5.2, token-in-token-out.

Kept from 0.5.2 because veRL and final depend on it: the receive loop (`handle_loop`) is created on the event loop
of the first call (`auto_create_handle_loop`), so an engine serves one event loop; requests are validated
(context length, vocabulary, SamplingParams(**params).verify) before they are sent; a batch is sent one request
at a time and gathered in order (n > 1: a max_new_tokens=0 prefix request per prompt, then n copies); outputs
carry 0.5.2's meta_info keys; `flush_cache` and memory release/resume go through a one-in-flight communicator.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
from collections import deque
from http import HTTPStatus
from typing import Any, Dict, List, Optional

import zmq
import zmq.asyncio

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GenerateReqInput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqOutput,
    TokenizedGenerateReqInput,
)
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils import get_zmq_socket

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ReqState:
    out_list: List[Dict[Any, Any]]
    finished: bool
    event: asyncio.Event
    obj: Any
    created_time: float
    finished_time: float = 0.0
    output_ids: List[int] = dataclasses.field(default_factory=list)
    input_token_logprobs_val: List[float] = dataclasses.field(default_factory=list)
    input_token_logprobs_idx: List[int] = dataclasses.field(default_factory=list)
    output_token_logprobs_val: List[float] = dataclasses.field(default_factory=list)
    output_token_logprobs_idx: List[int] = dataclasses.field(default_factory=list)


class TypeBasedDispatcher:
    """sglang/utils.py"""

    def __init__(self, mapping):
        self._mapping = mapping

    def __call__(self, obj: Any):
        for ty, fn in self._mapping:
            if isinstance(obj, ty):
                return fn(obj)
        raise ValueError(f"Invalid object: {obj}")


class _Communicator:
    """tokenizer_communicator_mixin.py: one request in flight; the answer arrives through handle_loop."""

    def __init__(self, sender, fan_out: int):
        self._sender = sender
        self._fan_out = fan_out
        self._result_event: Optional[asyncio.Event] = None
        self._result_values: Optional[List] = None
        self._ready_queue: deque = deque()

    async def __call__(self, obj):
        ready_event = asyncio.Event()
        if self._result_event is not None or len(self._ready_queue) > 0:
            self._ready_queue.append(ready_event)
            await ready_event.wait()
        if obj:
            self._sender.send_pyobj(obj)
        self._result_event = asyncio.Event()
        self._result_values = []
        await self._result_event.wait()
        result_values = self._result_values
        self._result_event = self._result_values = None
        if len(self._ready_queue) > 0:
            self._ready_queue.popleft().set()
        return result_values

    def handle_recv(self, recv_obj):
        self._result_values.append(recv_obj)
        if len(self._result_values) == self._fan_out:
            self._result_event.set()


class TokenizerManager:
    def __init__(self, server_args, port_args):
        self.server_args = server_args
        self.model_path = server_args.model_path
        self.served_model_name = server_args.served_model_name
        self.model_config = ModelConfig.from_server_args(server_args)
        self.context_len = self.model_config.context_len
        self.max_req_input_len = None  # set by engine.py once the scheduler is ready
        self.tokenizer = self.processor = None  # skip_tokenizer_init

        context = zmq.asyncio.Context(2)
        self.recv_from_detokenizer = get_zmq_socket(context, zmq.PULL, port_args.tokenizer_ipc_name, True)
        self.send_to_scheduler = get_zmq_socket(context, zmq.PUSH, port_args.scheduler_input_ipc_name, True)

        self.rid_to_state: Dict[str, ReqState] = {}
        self.asyncio_tasks = set()
        self.no_create_loop = False
        self.event_loop = None
        self.is_pause = False
        self.is_pause_cond = asyncio.Condition()

        self.flush_cache_communicator = _Communicator(self.send_to_scheduler, server_args.dp_size)
        self.release_memory_occupation_communicator = _Communicator(self.send_to_scheduler, server_args.dp_size)
        self.resume_memory_occupation_communicator = _Communicator(self.send_to_scheduler, server_args.dp_size)
        self._result_dispatcher = TypeBasedDispatcher([
            (BatchTokenIDOut, self._handle_batch_output),
            (AbortReq, self._handle_abort_req),
            (FlushCacheReqOutput, self.flush_cache_communicator.handle_recv),
            (ReleaseMemoryOccupationReqOutput, self.release_memory_occupation_communicator.handle_recv),
            (ResumeMemoryOccupationReqOutput, self.resume_memory_occupation_communicator.handle_recv),
        ])

    # ---- requests ------------------------------------------------------------------------------------------
    async def generate_request(self, obj: GenerateReqInput, request=None):
        created_time = time.time()
        self.auto_create_handle_loop()
        obj.normalize_batch_and_arguments()
        async with self.is_pause_cond:
            await self.is_pause_cond.wait_for(lambda: not self.is_pause)
        if obj.is_single:
            tokenized_obj = await self._tokenize_one_request(obj)
            state = self._send_one_request(obj, tokenized_obj, created_time)
            async for response in self._wait_one_response(obj, state, request):
                yield response
        else:
            async for response in self._handle_batch_request(obj, request, created_time):
                yield response

    async def _tokenize_one_request(self, obj: GenerateReqInput) -> TokenizedGenerateReqInput:
        if obj.input_ids is None:
            raise ValueError("The engine initialized with skip_tokenizer_init=True cannot accept text prompts. "
                             "Please provide input_ids or re-initialize the engine with skip_tokenizer_init=False.")
        if obj.contains_mm_input():
            raise ValueError("The fake SGLang serves text-only models; multimodal data is not accepted.")
        input_ids = obj.input_ids
        self._validate_one_request(obj, input_ids)
        if any(i >= self.model_config.vocab_size for i in input_ids):
            raise ValueError(f"The input_ids {input_ids} contains values greater than the vocab size "
                             f"({self.model_config.vocab_size}).")
        sampling_params = SamplingParams(**obj.sampling_params)
        sampling_params.normalize(self.tokenizer)
        sampling_params.verify(self.model_config.vocab_size)
        return TokenizedGenerateReqInput(
            obj.rid, None, input_ids, {}, sampling_params, obj.return_logprob, obj.logprob_start_len,
            obj.top_logprobs_num, obj.token_ids_logprob, obj.stream,
        )

    def _validate_one_request(self, obj, input_ids: List[int]) -> None:
        input_token_num = len(input_ids)
        if input_token_num >= self.context_len:
            raise ValueError(f"The input ({input_token_num} tokens) is longer than the model's context length "
                             f"({self.context_len} tokens).")
        max_new_tokens = obj.sampling_params.get("max_new_tokens")
        if max_new_tokens is not None and (max_new_tokens + input_token_num) >= self.context_len:
            total_tokens = max_new_tokens + input_token_num
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens. "
                f"You requested a total of {total_tokens} tokens: {input_token_num} tokens from the input messages "
                f"and {max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
                f"messages or the completion to fit within the limit.")

    def _send_one_request(self, obj, tokenized_obj, created_time: Optional[float] = None) -> ReqState:
        self.send_to_scheduler.send_pyobj(tokenized_obj)
        state = ReqState([], False, asyncio.Event(), obj, created_time=created_time)
        self.rid_to_state[obj.rid] = state
        return state

    async def _wait_one_response(self, obj, state: ReqState, request=None):
        while True:
            try:
                await asyncio.wait_for(state.event.wait(), timeout=4)
            except asyncio.TimeoutError:
                continue
            out = state.out_list[-1]
            state.out_list = []
            if state.finished:
                finish_reason = out["meta_info"].get("finish_reason")
                if isinstance(finish_reason, dict) and finish_reason.get("type") == "abort" and \
                        finish_reason.get("status_code") == HTTPStatus.BAD_REQUEST:
                    raise ValueError(finish_reason["message"])
                yield out
                break
            state.event.clear()
            if obj.stream:
                yield out

    async def _handle_batch_request(self, obj: GenerateReqInput, request=None, created_time=None):
        batch_size = obj.batch_size
        generators, rids = [], []
        if obj.parallel_sample_num == 1:
            for i in range(batch_size):
                tmp_obj = obj[i]
                tokenized_obj = await self._tokenize_one_request(tmp_obj)
                state = self._send_one_request(tmp_obj, tokenized_obj, created_time)
                generators.append(self._wait_one_response(tmp_obj, state, request))
                rids.append(tmp_obj.rid)
        else:
            objs = [obj[i] for i in range(batch_size)]
            tokenized_objs = await asyncio.gather(*(self._tokenize_one_request(o) for o in objs))
            # Cache the common prefix for parallel sampling
            for i in range(batch_size):
                tmp_obj = copy.copy(objs[i])
                tokenized_obj = copy.copy(tokenized_objs[i])
                tokenized_obj.rid = tmp_obj.regenerate_rid()
                tokenized_obj.sampling_params = copy.copy(tokenized_obj.sampling_params)
                tokenized_obj.sampling_params.max_new_tokens = 0
                tokenized_obj.stream = False
                state = self._send_one_request(tmp_obj, tokenized_obj, created_time)
                await self._wait_one_response(tmp_obj, state, request).__anext__()
            for i in range(batch_size):
                for _ in range(obj.parallel_sample_num):
                    tmp_obj = copy.copy(objs[i])
                    tokenized_obj = copy.copy(tokenized_objs[i])
                    tokenized_obj.rid = tmp_obj.regenerate_rid()
                    state = self._send_one_request(tmp_obj, tokenized_obj, created_time)
                    generators.append(self._wait_one_response(tmp_obj, state, request))
                    rids.append(tmp_obj.rid)
        outputs = await asyncio.gather(*(gen.__anext__() for gen in generators))
        yield outputs

    def abort_request(self, rid: str = "", abort_all: bool = False):
        if not abort_all and rid not in self.rid_to_state:
            return
        self.send_to_scheduler.send_pyobj(AbortReq(rid, abort_all))

    # ---- control ------------------------------------------------------------------------------------------
    async def flush_cache(self) -> FlushCacheReqOutput:
        return (await self.flush_cache_communicator(FlushCacheReqInput()))[0]

    async def release_memory_occupation(self, obj, request=None):
        self.auto_create_handle_loop()
        await self.release_memory_occupation_communicator(obj)

    async def resume_memory_occupation(self, obj, request=None):
        self.auto_create_handle_loop()
        await self.resume_memory_occupation_communicator(obj)

    # ---- the receive loop ---------------------------------------------------------------------------------
    def auto_create_handle_loop(self):
        if self.no_create_loop:
            return
        self.no_create_loop = True
        loop = asyncio.get_event_loop()
        self.asyncio_tasks.add(loop.create_task(self.handle_loop()))
        self.event_loop = loop

    async def handle_loop(self):
        while True:
            recv_obj = await self.recv_from_detokenizer.recv_pyobj()
            self._result_dispatcher(recv_obj)

    def _handle_batch_output(self, recv_obj: BatchTokenIDOut):
        for i, rid in enumerate(recv_obj.rids):
            state = self.rid_to_state.get(rid, None)
            if state is None:
                logger.error(f"Received output for {rid=} but the state was deleted in TokenizerManager.")
                continue
            meta_info = {
                "id": rid,
                "finish_reason": recv_obj.finished_reasons[i],
                "prompt_tokens": recv_obj.prompt_tokens[i],
                "weight_version": self.server_args.weight_version,
            }
            if getattr(state.obj, "return_logprob", False):
                state.input_token_logprobs_val.extend(recv_obj.input_token_logprobs_val[i])
                state.input_token_logprobs_idx.extend(recv_obj.input_token_logprobs_idx[i])
                state.output_token_logprobs_val.extend(recv_obj.output_token_logprobs_val[i])
                state.output_token_logprobs_idx.extend(recv_obj.output_token_logprobs_idx[i])
                # detokenize_logprob_tokens without text: (logprob, token_id, None)
                meta_info["input_token_logprobs"] = [
                    (v, t, None) for v, t in zip(state.input_token_logprobs_val, state.input_token_logprobs_idx)]
                meta_info["output_token_logprobs"] = [
                    (v, t, None) for v, t in zip(state.output_token_logprobs_val, state.output_token_logprobs_idx)]
            meta_info.update({"completion_tokens": recv_obj.completion_tokens[i],
                              "cached_tokens": recv_obj.cached_tokens[i]})
            state.output_ids.extend(recv_obj.output_ids[i])
            out_dict = {"output_ids": state.output_ids.copy(), "meta_info": meta_info}
            state.finished = recv_obj.finished_reasons[i] is not None
            if state.finished:
                state.finished_time = time.time()
                meta_info["e2e_latency"] = state.finished_time - state.created_time
                del self.rid_to_state[rid]
            state.out_list.append(out_dict)
            state.event.set()

    def _handle_abort_req(self, recv_obj: AbortReq):
        state = self.rid_to_state.get(recv_obj.rid)
        if state is None:
            return
        state.finished = True
        state.out_list.append({
            "output_ids": state.output_ids.copy(),
            "meta_info": {"id": recv_obj.rid, "finish_reason": recv_obj.finished_reason,
                          "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0},
        })
        del self.rid_to_state[recv_obj.rid]
        state.event.set()
