"""veRL 0.6.0's SGLangRollout and AsyncEngine, subclassed for in-process use.

Imports sglang, so it is loaded only after rollout_052.py has checked that SGLang can run here.
- InProcessSGLangRollout: veRL's class as is, except that its engine is a FinalSGLangEngine and SGLang's
  scheduler child runs final.rollout.sglang.scheduler.run_scheduler_process (cartridge RPCs); the per-row
  cartridge choice (non_tensor_batch["cartridges"]) is handed to the engine call through context variables,
  because veRL's multi-turn path re-tokenizes prompts and never sees our prefix.
- FinalSGLangEngine: veRL's AsyncEngine with our ServerArgs (veRL 0.6.0 passes only attention_backend from
  engine_kwargs.sglang, and a fixed port), a record of the processes it started (shutdown kills those only;
  SGLang's own shutdown kills every child of the process), and cartridge prefixes on every generate call.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import functools
import os
import threading
from typing import Any, Iterator

import psutil
import torch
from torch.distributed.device_mesh import init_device_mesh

from final.rollout.sglang.procs import keep_event_loop_policy

with keep_event_loop_policy():
    import sglang.srt.entrypoints.engine as sgl_engine
    import verl.workers.rollout.sglang_rollout.sglang_rollout as verl_sglang

from final.errors import EngineError, PromptError
from final.outputs import ROW_INFO, TRACE_KEY, row_infos
from final.prompts import object_array
from final.rollout.sglang import scheduler as sglang_scheduler
from final.rollout.batch import logprob_request, row_cartridges, single_turn
from final.rollout.sglang.cartridges import (ModelDims, SGLangCartridges, check_prefix_hit, flush_until_idle,
                                             shift_starts)
from final.rollout.sglang.procs import kill_processes, new_children

# Batch path: one tuple of cartridge ids per DataProto row. Multi-turn path: the tuple of the request's row.
BATCH_CARTRIDGES: contextvars.ContextVar = contextvars.ContextVar("final_batch_cartridges", default=None)
REQUEST_CARTRIDGES: contextvars.ContextVar = contextvars.ContextVar("final_request_cartridges", default=None)
# final.outputs.ROW_INFO: the engine's result dicts of this call (batch path) / of this request (multi-turn)
BATCH_OUTPUTS: contextvars.ContextVar = contextvars.ContextVar("final_batch_outputs", default=None)
REQUEST_RECORD: contextvars.ContextVar = contextvars.ContextVar("final_request_record", default=None)
# final.outputs.TRACE_KEY: the tool calls of this request (name, arguments, response, reward), as final's own loop
# records them; veRL keeps none (with skip_tokenizer_init it even erases the message's tool_calls)
REQUEST_TOOL_CALLS: contextvars.ContextVar = contextvars.ContextVar("final_request_tool_calls", default=None)
# Scoring / top-k: the engine arguments beyond veRL's (final.rollout.batch.logprob_request) for this call's batch
LOGPROB_ARGS: contextvars.ContextVar = contextvars.ContextVar("final_logprob_args", default=None)
_START_LOCK = threading.Lock()  # the patches below are module globals: one engine start at a time


@contextlib.contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


class FinalSGLangEngine(verl_sglang.AsyncEngine):
    def __init__(self, *, final_server_args: dict, **kwargs: Any):
        kwargs.update(final_server_args)
        before = {p.pid for p in psutil.Process().children()}
        try:
            super().__init__(**kwargs)
        except BaseException as exc:
            _close_sockets(exc.__traceback__)
            raise
        finally:  # also on failure, so that shutdown never leaves a half-started scheduler behind
            self.processes = new_children(before)
        self.cartridges: SGLangCartridges | None = None
        self._closed = False

    async def async_generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                             image_data: Any = None, return_logprob: Any = False, logprob_start_len: Any = None,
                             **kwargs: Any) -> Any:
        if isinstance(input_ids, torch.Tensor):
            # veRL 0.6.0's multi-turn log-prob call passes _req.input_ids, a [1, L] tensor, which SGLang 0.5.2's
            # GenerateReqInput refuses ("input_ids should be a list of lists"): it means one prompt.
            input_ids = input_ids.reshape(-1).tolist() if input_ids.dim() == 2 and len(input_ids) == 1 \
                else input_ids.tolist()
        self._check_vocabulary(input_ids)
        extra = LOGPROB_ARGS.get()
        if extra and return_logprob and not _rows(input_ids)[0]:  # veRL's batch call of a scoring/top-k request
            logprob_start_len = extra.get("logprob_start_len", logprob_start_len)
            kwargs = {**kwargs, "top_logprobs_num": extra.get("top_logprobs_num", 0)}
        out = await self._generate_with_cartridges(dict(
            prompt=prompt, sampling_params=sampling_params, input_ids=input_ids, image_data=image_data,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len, **kwargs))
        _record(out)
        return out

    async def _generate_with_cartridges(self, call: dict) -> Any:
        input_ids, logprob_start_len = call["input_ids"], call["logprob_start_len"]
        plan = self._cartridge_plan(input_ids, call["sampling_params"])
        if plan is None:
            return await self._generate(call)
        single, rows, prefixes = plan
        ids = [p + list(r) for p, r in zip(prefixes, rows)]
        starts = shift_starts(logprob_start_len, prefixes)
        out = await self._generate({**call, "input_ids": ids[0] if single else ids,
                                    "logprob_start_len": starts[0] if single else starts})
        outs = out if isinstance(out, list) else [out]
        n = len(outs) // len(rows)  # parallel sampling returns n outputs per prompt, prompt-major
        for j, o in enumerate(outs):
            check_prefix_hit(o, len(prefixes[j // n]))
        return out

    async def _generate(self, call: dict) -> Any:
        try:
            return await super().async_generate(**call)
        except ValueError as exc:  # SGLang's request checks: context length, vocabulary, logprob_start_len
            raise PromptError(f"SGLang rejected the request: {exc}") from exc

    def _check_vocabulary(self, input_ids: Any) -> None:
        """SGLang 0.5.2 never calls its own _validate_input_ids_in_vocab: an id past the embedding reaches the
        model in the scheduler (IndexError on CPU, a device-side assert on CUDA) and kills it for every caller."""
        if not input_ids:
            return
        vocab = self.tokenizer_manager.model_config.vocab_size
        for i, row in enumerate(_rows(input_ids)[1]):
            bad = next((t for t in row if not 0 <= t < vocab), None)
            if bad is not None:
                raise PromptError(f"token id {bad} is outside the model's vocabulary (0..{vocab - 1})", i)

    def _cartridge_plan(self, input_ids: Any, sampling_params: Any):
        if self.cartridges is None or not input_ids or not self.cartridges.active():
            return None
        single, rows = _rows(input_ids)
        if single:
            wanted = [REQUEST_CARTRIDGES.get() or ()]
        else:
            wanted = BATCH_CARTRIDGES.get() or [()] * len(rows)
            if len(wanted) != len(rows):
                raise EngineError(f"{len(wanted)} cartridge choices for {len(rows)} prompts")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(rows)
        prefixes = self.cartridges.prefixes(rows, wanted, params, self.tokenizer_manager.context_len)
        return (single, rows, prefixes) if any(prefixes) else None

    async def flush_cache(self):
        # The tokenizer manager answers through its receive loop, which only a first request would create.
        self.tokenizer_manager.auto_create_handle_loop()
        retired = self.cartridges.retired() if self.cartridges is not None else []
        out = await flush_until_idle(super().flush_cache)
        if self.cartridges is not None and out.success:
            self.cartridges.after_flush(retired)
        return out

    def cancel_tasks(self) -> None:
        """Stop the tokenizer manager's receive loop (call on the engine's event loop thread, loop not running)."""
        tasks = list(getattr(self.tokenizer_manager, "asyncio_tasks", ()))
        for task in tasks:
            task.cancel()
        loop = tasks[0].get_loop() if tasks else None
        if loop is not None and not loop.is_running() and not loop.is_closed():
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    def shutdown(self) -> None:
        """Kill this engine's processes and close its sockets (safe from any thread, twice, and at exit)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        kill_processes(self.processes)
        for sock in (getattr(self.tokenizer_manager, "recv_from_detokenizer", None),
                     getattr(self.tokenizer_manager, "send_to_scheduler", None), self.send_to_rpc):
            if sock is not None:
                sock.close(linger=0)
        for name in ("tokenizer_ipc_name", "scheduler_input_ipc_name", "detokenizer_ipc_name", "rpc_ipc_name",
                     "metrics_ipc_name"):
            path = str(getattr(self.port_args, name, "") or "")
            if path.startswith("ipc://"):
                with contextlib.suppress(OSError):
                    os.unlink(path[len("ipc://"):])
        if self.cartridges is not None:
            self.cartridges.close()


def _close_sockets(tb: Any) -> None:
    """An engine that failed to start leaves its TokenizerManager's ZMQ sockets open inside a reference cycle, and
    when the garbage collector finalises their Context first, Context.term() blocks forever. Close them now (the
    manager is a local of SGLang's _launch_subprocesses in the failed frames)."""
    while tb is not None:
        manager = tb.tb_frame.f_locals.get("tokenizer_manager")
        for name in ("recv_from_detokenizer", "send_to_scheduler"):
            sock = getattr(manager, name, None)
            if sock is not None:
                sock.close(linger=0)
        tb = tb.tb_next


def _record(out: Any) -> None:
    """Keep the engine's results for final.outputs.ROW_INFO: a batch call's list, or a request's turns."""
    batch, record = BATCH_OUTPUTS.get(), REQUEST_RECORD.get()
    if record is not None and isinstance(out, dict):
        record.append(out)
    elif batch is not None and isinstance(out, list):
        batch.extend(out)


def _rows(input_ids: Any) -> tuple[bool, list]:
    """(one prompt?, its rows): SGLang takes one list of ids or a list of them (ints may be numpy's)."""
    single = not isinstance(input_ids[0], (list, tuple)) and getattr(input_ids[0], "ndim", 0) == 0
    return single, [input_ids] if single else input_ids


class InProcessSGLangRollout(verl_sglang.SGLangRollout):
    def __init__(self, config: Any, model_config: Any, server_args: dict):
        self._final_server_args = server_args
        super().__init__(config, model_config, None)
        # veRL's update_weights / release / resume read device_mesh["infer_tp"], which its FSDP worker passes in;
        # one engine in this process is a 1 x 1 mesh over the process group final made
        self.device_mesh = init_device_mesh("cpu", mesh_shape=(1, 1), mesh_dim_names=("dp", "infer_tp"))
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        dims = ModelDims.of(model_config.hf_config)
        self._engine.cartridges = SGLangCartridges(self._engine, dims, len(tokenizer), tokenizer.all_special_ids)
        self._final_tool_calls: dict = {}
        for name, tool in self._tool_map.items():
            tool.execute = _recording(tool.execute, name)

    @property
    def engine(self) -> FinalSGLangEngine:
        return self._engine

    def _init_inference_engine(self, trust_remote_code: bool, actor_module: str, port: Any) -> None:
        factory = functools.partial(FinalSGLangEngine, final_server_args=self._final_server_args)
        with _START_LOCK, keep_event_loop_policy(), _patched(verl_sglang, "AsyncEngine", factory), \
                _patched(sgl_engine, "run_scheduler_process", sglang_scheduler.run_scheduler_process):
            super()._init_inference_engine(trust_remote_code, actor_module, port)

    def generate_sequences(self, prompts: Any, **kwargs: Any) -> Any:
        """veRL's generate_sequences, with what veRL's call cannot carry set in context for the engine wrapper.
        veRL's batch path calls engine.async_generate(..., return_logprob=True) on this (the owner) thread without
        SGLang's logprob_start_len or top_logprobs_num; FinalSGLangEngine.async_generate adds them from
        LOGPROB_ARGS, so scoring and top-k run on SGLang's own logprob machinery. Such a call is one batch (a
        multi-turn conversation has no single prompt to score), as on the embedded engine."""
        extra = logprob_request(prompts)
        token = BATCH_CARTRIDGES.set(row_cartridges(prompts))
        outputs: list = []
        records: dict = {}
        tokens = (BATCH_OUTPUTS.set(outputs), REQUEST_RECORD.set(None), LOGPROB_ARGS.set(extra or None))
        self._final_records = records
        try:
            if single_turn(prompts):  # scoring, or tools only offered: one turn, even with multi-turn on
                out = self._batch_level_generate_sequences(prompts, **kwargs)
            else:
                out = super().generate_sequences(prompts, **kwargs)
        finally:
            BATCH_CARTRIDGES.reset(token)
            for var, t in zip((BATCH_OUTPUTS, REQUEST_RECORD, LOGPROB_ARGS), tokens):
                var.reset(t)
        if prompts.meta_info.get(TRACE_KEY) and "messages" in out.non_tensor_batch:
            out.non_tensor_batch["tool_calls"] = object_array(
                [self._final_tool_calls.pop(rid, []) for rid in out.non_tensor_batch["request_id"]])
        if prompts.meta_info.get(ROW_INFO):
            out.non_tensor_batch[ROW_INFO] = object_array(
                _conversation_infos(out, records) if "messages" in out.non_tensor_batch
                else row_infos(outputs, "logprob_start_len" in extra))
        return out

    async def _async_rollout_a_request(self, req: Any, do_sample: bool = True, is_validate: bool = False,
                                       **kwargs: Any) -> Any:
        rows = BATCH_CARTRIDGES.get()
        REQUEST_CARTRIDGES.set(rows[req.batch_data_id] if rows else None)  # this request's task context only
        turns: list = []
        calls: list = []
        REQUEST_RECORD.set(turns)
        REQUEST_TOOL_CALLS.set(calls)
        done = await super()._async_rollout_a_request(req, do_sample, is_validate, **kwargs)
        self._final_records[done.request_id] = turns
        assistant = [i for i, m in enumerate(done.messages) if m.role == "assistant"]
        for call in calls:  # the calling turn's message (turn k is the k-th assistant message)
            call["message_index"] = assistant[call["turn"] - 1] if 0 < call["turn"] <= len(assistant) else None
        self._final_tool_calls[done.request_id] = calls
        return done


def _recording(execute: Any, name: str) -> Any:
    """A tool's execute that also appends the call to its request's REQUEST_TOOL_CALLS (the turn is the number of
    engine calls the request has made so far: the assistant turn that wrote the call)."""

    async def execute_and_record(instance_id: str, parameters: dict, **kwargs: Any) -> Any:
        response, reward, metrics = await execute(instance_id, parameters, **kwargs)
        calls = REQUEST_TOOL_CALLS.get()
        if calls is not None:
            calls.append({"turn": len(REQUEST_RECORD.get() or []), "name": name, "arguments": parameters,
                          "response": response.text, "reward": reward, "error": None})
        return response, reward, metrics

    return execute_and_record


def _conversation_infos(out: Any, records: dict) -> list[dict]:
    """Multi-turn ROW_INFO: the first turn's prompt and cached tokens, the last turn's finish, the model's
    tokens (veRL's response mask)."""
    infos = []
    for i, rid in enumerate(out.non_tensor_batch["request_id"]):
        turns = [t for t in records.get(rid, []) if t["meta_info"].get("finish_reason")]
        first = row_infos(turns[:1])[0] if turns else {"prompt_tokens": 0, "cached_tokens": 0}
        last = row_infos(turns[-1:])[0] if turns else {"finish_reason": None, "matched": None}
        infos.append({**first, "finish_reason": last["finish_reason"], "matched": last["matched"],
                      "completion_tokens": int(out.batch["response_mask"][i].sum()), "logprobs": None})
    return infos
