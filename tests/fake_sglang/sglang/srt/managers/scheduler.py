"""Mirrors sglang/srt/managers/scheduler.py (+ scheduler_update_weights_mixin.py) of 0.5.2: the scheduler process.

What is 0.5.2's: `run_scheduler_process` (its signature, the "ready" handshake over the pipe, SIGQUIT to the parent
when the scheduler dies), the ZMQ sockets, the attributes other code reaches into (`tree_cache`,
`token_to_kv_pool_allocator`, `offload_tags`, `max_total_num_tokens`), `handle_rpc_request` (getattr(self, method)
(parameters), then a barrier), `flush_cache` (refused while requests run; resets the tree and the allocator),
memory release/resume (release flushes; the pool's content does not survive a release), the prefix match of a
new request (`Req.adjust_max_prefix_ids`: at most len-1 tokens, and no further than logprob_start_len when
logprobs are returned), locking the matched node while the request runs, and `check_memory` when idle.

What is the fake's: the forward pass. A request's matched prefix is gathered from the pool's k_buffer/v_buffer
and handed to the embedded engine as a prefix; the rest of the prompt runs on the embedded engine.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
from http import HTTPStatus
from typing import Optional

import psutil
import torch
import torch.distributed as dist
import zmq
import zmq.asyncio

from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    ReleaseMemoryOccupationReqInput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqInput,
    ResumeMemoryOccupationReqOutput,
    RpcReqInput,
    RpcReqOutput,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.tokenizer_manager import TypeBasedDispatcher
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.sampling.sampling_params import TOP_K_ALL
from sglang.srt.utils import configure_logger, get_exception_traceback, get_zmq_socket, kill_itself_when_parent_died

logger = logging.getLogger(__name__)

GPU_MEMORY_TYPE_KV_CACHE = "kv_cache"  # sglang/srt/constants.py
GPU_MEMORY_TYPE_WEIGHTS = "weights"
FAKE_DEFAULT_POOL_TOKENS = 2048  # 0.5.2 sizes the pool from free GPU memory; the fake keeps it small


class Scheduler:
    def __init__(self, server_args, port_args, gpu_id: int, tp_rank: int, moe_ep_rank: int, pp_rank: int,
                 dp_rank: Optional[int], dp_balance_meta=None):
        from final.engine import EmbeddedEngine  # the fake's forward pass

        self.server_args = server_args
        self.gpu_id, self.tp_rank, self.pp_rank, self.dp_rank = gpu_id, tp_rank, pp_rank, dp_rank
        # The model runner's init_distributed_environment: a TCP store on nccl_port (a busy port fails here).
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port_args.nccl_port}", world_size=1, rank=0)
        self.tp_cpu_group = dist.group.WORLD

        context = zmq.asyncio.Context(2)
        self.recv_from_tokenizer = get_zmq_socket(context, zmq.PULL, port_args.scheduler_input_ipc_name, False)
        self.recv_from_rpc = get_zmq_socket(context, zmq.DEALER, port_args.rpc_ipc_name, False)
        self.send_to_tokenizer = get_zmq_socket(context, zmq.PUSH, port_args.tokenizer_ipc_name, False)
        # skip_tokenizer_init: "Directly send to the TokenizerManager"
        self.send_to_detokenizer = get_zmq_socket(context, zmq.PUSH, port_args.tokenizer_ipc_name, False)

        device = server_args.device
        self.engine = EmbeddedEngine(
            server_args.model_path, dtype=server_args.dtype, device=device,
            max_running_requests=server_args.max_running_requests or 256, max_model_len=server_args.context_length,
            mem_fraction_static=server_args.mem_fraction_static, random_seed=server_args.random_seed)
        spec = self.engine.spec
        self.max_total_num_tokens = server_args.max_total_tokens or FAKE_DEFAULT_POOL_TOKENS
        self.max_req_input_len = self.engine.max_model_len - 1
        self.token_to_kv_pool = MHATokenToKVPool(
            self.max_total_num_tokens, page_size=1, dtype=self.engine.dtype, head_num=spec.num_kv_heads,
            head_dim=spec.head_dim, layer_num=spec.num_layers, device=device,
            enable_memory_saver=server_args.enable_memory_saver)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(
            self.max_total_num_tokens, dtype=self.engine.dtype, device=device, kvcache=self.token_to_kv_pool,
            need_sort=False)
        self.tree_cache = RadixCache(req_to_token_pool=None, token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
                                     page_size=server_args.page_size, disable=server_args.disable_radix_cache)
        self.offload_tags = set()
        self.running: dict[str, asyncio.Task] = {}
        self._request_dispatcher = TypeBasedDispatcher([
            (TokenizedGenerateReqInput, self.handle_generate_request),
            (FlushCacheReqInput, self.flush_cache_wrapped),
            (AbortReq, self.abort_request),
            (ReleaseMemoryOccupationReqInput, self.release_memory_occupation),
            (ResumeMemoryOccupationReqInput, self.resume_memory_occupation),
            (RpcReqInput, self.handle_rpc_request),
        ])

    # ---- the event loop --------------------------------------------------------------------------------
    def event_loop_normal(self):
        asyncio.run(self._serve())

    async def _serve(self):
        # 0.5.2 drains both sockets with NOBLOCK and runs a batch; the fake awaits the sockets instead of spinning.
        self._fatal = asyncio.get_running_loop().create_future()
        poller = zmq.asyncio.Poller()
        poller.register(self.recv_from_tokenizer, zmq.POLLIN)
        poller.register(self.recv_from_rpc, zmq.POLLIN)
        while True:
            poll = asyncio.ensure_future(poller.poll())
            await asyncio.wait({poll, self._fatal}, return_when=asyncio.FIRST_COMPLETED)
            if self._fatal.done():
                poll.cancel()
                raise self._fatal.exception()
            events = dict(poll.result())
            for sock in (self.recv_from_tokenizer, self.recv_from_rpc):
                while sock in events:
                    try:
                        recv_req = await sock.recv_pyobj(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    output = self._request_dispatcher(recv_req)
                    if isinstance(output, RpcReqOutput):
                        await self.recv_from_rpc.send_pyobj(output)
                    elif output is not None:
                        await self.send_to_tokenizer.send_pyobj(output)

    # ---- generation --------------------------------------------------------------------------------------
    def handle_generate_request(self, recv_req: TokenizedGenerateReqInput):
        n_in = len(recv_req.input_ids)
        if recv_req.logprob_start_len == -1 or not recv_req.return_logprob:
            logprob_start_len = n_in - 1  # by default, only the logprobs of output tokens
        else:
            logprob_start_len = recv_req.logprob_start_len
        if logprob_start_len >= n_in:
            self._send_abort(recv_req.rid, f"{logprob_start_len=} is higher than the number of input tokens "
                                           f"{n_in=}. Please use a smaller logprob_start_len.", HTTPStatus.BAD_REQUEST)
            return
        self.running[recv_req.rid] = asyncio.ensure_future(self._run_guarded(recv_req, logprob_start_len))

    async def _run_guarded(self, req: TokenizedGenerateReqInput, logprob_start_len: int):
        try:
            await self._run(req, logprob_start_len)
            if not self.running:
                self.self_check_during_idle()
        except Exception as exc:  # as in 0.5.2, anything else kills the scheduler (and SIGQUITs the parent)
            if not self._fatal.done():
                self._fatal.set_exception(exc)

    async def _run(self, req: TokenizedGenerateReqInput, logprob_start_len: int):
        ids = list(req.input_ids)
        max_prefix_len = len(ids) - 1  # Req.adjust_max_prefix_ids
        if req.return_logprob:
            max_prefix_len = min(max_prefix_len, logprob_start_len)
        match = self.tree_cache.match_prefix(key=ids[:max(max_prefix_len, 0)])
        prefix_indices, last_node = match.device_indices, match.last_device_node
        self.tree_cache.inc_lock_ref(last_node)
        cached = len(prefix_indices)
        prefix_id = f"radix:{req.rid}"
        try:
            if cached:
                pool = self.token_to_kv_pool
                layers = range(pool.layer_num)
                keys = [pool.get_key_buffer(layer)[prefix_indices].transpose(0, 1) for layer in layers]
                values = [pool.get_value_buffer(layer)[prefix_indices].transpose(0, 1) for layer in layers]
                self.engine.load_cartridge(prefix_id, keys, values)
            out = await self.engine.async_generate(
                input_ids=ids[cached:], sampling_params=_engine_params(req.sampling_params), rid=req.rid,
                return_logprob=req.return_logprob,
                logprob_start_len=logprob_start_len - cached if req.return_logprob else None,
                cartridges=(prefix_id,) if cached else None)
        except Exception as exc:  # the embedded engine refused the request: SGLang aborts it with 400
            self._send_abort(req.rid, f"{type(exc).__name__}: {exc}", HTTPStatus.BAD_REQUEST)
            return
        finally:
            self.engine.unload_cartridge(prefix_id)
            self.tree_cache.dec_lock_ref(last_node)
            self.running.pop(req.rid, None)
        meta = out["meta_info"]
        in_lp = meta.get("input_token_logprobs", [])
        out_lp = meta.get("output_token_logprobs", [])
        await self.send_to_detokenizer.send_pyobj(BatchTokenIDOut(
            rids=[req.rid], finished_reasons=[meta["finish_reason"]], output_ids=[out["output_ids"]],
            prompt_tokens=[len(ids)], completion_tokens=[len(out["output_ids"])], cached_tokens=[cached],
            input_token_logprobs_val=[[v for v, _, _ in in_lp]], input_token_logprobs_idx=[[t for _, t, _ in in_lp]],
            output_token_logprobs_val=[[v for v, _, _ in out_lp]],
            output_token_logprobs_idx=[[t for _, t, _ in out_lp]]))

    def _send_abort(self, rid: str, message: str, status_code: HTTPStatus):
        reason = {"type": "abort", "message": message, "status_code": status_code}
        self.send_to_detokenizer.send_pyobj(BatchTokenIDOut(
            rids=[rid], finished_reasons=[reason], output_ids=[[]], prompt_tokens=[0], completion_tokens=[0],
            cached_tokens=[0], input_token_logprobs_val=[[]], input_token_logprobs_idx=[[]],
            output_token_logprobs_val=[[]], output_token_logprobs_idx=[[]]))

    def abort_request(self, recv_req: AbortReq):
        self.engine.abort_request(rid=recv_req.rid, abort_all=recv_req.abort_all)

    # ---- cache and memory --------------------------------------------------------------------------------
    def flush_cache_wrapped(self, recv_req: FlushCacheReqInput):
        return FlushCacheReqOutput(success=self.flush_cache())

    def flush_cache(self):
        if not self.running:
            self.tree_cache.reset()
            self.token_to_kv_pool_allocator.clear()
            self.engine.flush_cache()
            logger.info("Cache flushed successfully!")
            return True
        logging.warning(f"Cache not flushed because there are pending requests. #running-req: {len(self.running)}")
        return False

    def release_memory_occupation(self, recv_req: ReleaseMemoryOccupationReqInput):
        tags = recv_req.tags or [GPU_MEMORY_TYPE_WEIGHTS, GPU_MEMORY_TYPE_KV_CACHE]
        self.offload_tags.update(tags)
        if GPU_MEMORY_TYPE_KV_CACHE in tags:
            self.flush_cache()
            self.engine.release_memory_occupation()
        return ReleaseMemoryOccupationReqOutput()

    def resume_memory_occupation(self, recv_req: ResumeMemoryOccupationReqInput):
        tags = recv_req.tags or [GPU_MEMORY_TYPE_WEIGHTS, GPU_MEMORY_TYPE_KV_CACHE]
        for tag in tags:
            self.offload_tags.remove(tag)
        if GPU_MEMORY_TYPE_KV_CACHE in tags:
            # Released memory comes back without its content (torch_memory_saver remaps fresh pages).
            for buf in self.token_to_kv_pool.k_buffer + self.token_to_kv_pool.v_buffer:
                buf.zero_()
        return ResumeMemoryOccupationReqOutput()

    def self_check_during_idle(self):
        self.check_memory()

    def check_memory(self):
        available_size = self.token_to_kv_pool_allocator.available_size()
        evictable_size = self.tree_cache.evictable_size()
        protected_size = self.tree_cache.protected_size()
        if (available_size + evictable_size) != (self.max_total_num_tokens - protected_size):
            raise ValueError("token_to_kv_pool_allocator memory leak detected! "
                             f"{self.max_total_num_tokens=}, {available_size=}, {evictable_size=}, {protected_size=}\n")

    # ---- rpc ---------------------------------------------------------------------------------------------
    def handle_rpc_request(self, recv_req: RpcReqInput):
        logger.info(f"handle_rpc_request: {recv_req.method}, param: {recv_req.parameters}")
        success = True
        exec = None
        try:
            func = getattr(self, recv_req.method)
            func(recv_req.parameters)
        except Exception as e:
            success = False
            exec = e
            logger.error(f"Failed to call rpc {recv_req.method}: {str(e)}")
        dist.barrier(group=self.tp_cpu_group)
        return RpcReqOutput(success, "" if not exec else str(exec))


def _engine_params(sp) -> dict:
    """SGLang's normalised SamplingParams -> the embedded engine's sampling dict (same vocabulary)."""
    return {
        "max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
        "top_k": -1 if sp.top_k >= TOP_K_ALL else sp.top_k, "min_p": sp.min_p, "min_new_tokens": sp.min_new_tokens,
        "stop": sp.stop_strs or [], "stop_token_ids": sorted(sp.stop_token_ids or []), "ignore_eos": sp.ignore_eos,
        "presence_penalty": sp.presence_penalty, "frequency_penalty": sp.frequency_penalty,
        "repetition_penalty": sp.repetition_penalty,
    }


def run_scheduler_process(server_args, port_args, gpu_id: int, tp_rank: int, moe_ep_rank: int, pp_rank: int,
                          dp_rank: Optional[int], pipe_writer, balance_meta=None):
    faulthandler.enable()
    kill_itself_when_parent_died()
    parent_process = psutil.Process().parent()
    configure_logger(server_args, prefix=" fake-scheduler")
    try:
        scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank)
        pipe_writer.send({"status": "ready", "max_total_num_tokens": scheduler.max_total_num_tokens,
                          "max_req_input_len": scheduler.max_req_input_len})
        scheduler.event_loop_normal()
    except Exception:
        traceback = get_exception_traceback()
        logger.error(f"Scheduler hit an exception: {traceback}")
        parent_process.send_signal(signal.SIGQUIT)
