"""rollout.name: sglang on the verl09 lane — SGLang's own Engine (sglang 0.5.12, veRL 0.9.1's pin), in-process.

Why not veRL 0.9's SGLang classes: veRL 0.9.1 removed the in-process SGLangRollout. Its SGLang path is
`SGLangHttpServer`, a Ray actor that launches SGLang's HTTP server on the node's address, and `ServerAdapter`, the
trainer-side weight sync. For one engine in the caller's process, that adds Ray, a socket and an HTTP hop. final
uses none of it. So this backend drives `sglang.Engine` directly, speaking final's engine dialect, under
EngineRollout. It gets the same batch path, multi-turn tool calling and DataProto as the local and tokasaurus
backends (final/rollout/engine_rollout.py).

What it shares with the verl06 lane's backend (rollout_052.py, in this folder):
- the requirements, the ServerArgs translation and checks (config.py);
- the process handling (procs.py): the engine's own children only, and SIGQUIT survival;
- the event-loop policy SGLang swaps for uvloop's is restored.

What differs:
- SGLang 0.5.12 has per-request seeds (`sampling_seed`), so `seed` works per row.
- SGLang loads its tokenizer (skip_tokenizer_init false in its ServerArgs). Stop strings are then SGLang's own;
  prompts and outputs are still token ids.
- Cartridges are not served on this lane: the 0.5.2 scheduler injection (scheduler.py) is not ported to
  0.5.12's scheduler. A request naming one gets an UnsupportedError; use the local backend for cartridges.
- No token streams: astream yields each row when it finishes.

The engine runs on its own thread with its own event loop (SGLang binds to the loop of its first request), so
calls from any thread or loop overlap there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import concurrent.futures.thread  # noqa: F401 - its exit hook, before SGLang disables threading._register_atexit
import importlib.util
import logging
import threading
import uuid
from typing import Any, Callable

import psutil
import torch

from final.engine.messages import Submission
from final.errors import BackendUnavailableError, EngineError, PromptError, SamplingError, UnsupportedError
from final.rollout.base import Capabilities
from final.rollout.engine_rollout import EngineRollout
from final.rollout.sglang.config import check_sampling_key, preflight, require_sglang, sglang_device, \
    translate_config
from final.rollout.sglang.procs import (POLL_S, ProcessWatch, cancel_all, keep_event_loop_policy, kill_processes,
                                        new_children, survive_sigquit)
from final.rollout.thread import gather_or_cancel

logger = logging.getLogger(__name__)

GRPC_PORT_LIMIT = 65535 - 10000  # ServerArgs refuses a port whose port + 10000 (its gRPC port) exceeds 65535
NO_CARTRIDGES = ("the verl09 lane's SGLang backend does not inject cartridges (SGLang 0.5.12's scheduler has no "
                 "port of final's 0.5.2 injection): use rollout.name local, or the verl06 lane's sglang backend")
NO_SEED = ("SGLang 0.5.12 honours a per-request seed only with deterministic inference: set "
           "rollout.engine_kwargs.sglang.enable_deterministic_inference: true (batch-invariant kernels, slower)")


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
            # final passes no grammar constraints (json_schema/regex/ebnf are not sampling keys it serves), and
            # SGLang's default, xgrammar, is a compiled package its scheduler would import for nothing
            "grammar_backend": "none", **extra}
    if device == "cpu":
        args.setdefault("disable_cuda_graph", True)
        args.setdefault("disable_piecewise_cuda_graph", True)
    return args


def check_sampling_params(params: dict, vocab_size: int) -> None:
    """SGLang's own SamplingParams checks, run here so a bad value is a SamplingError naming the key before any
    request reaches the engine (SGLang raises TypeError / ValueError from its tokenizer manager)."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    for key in params:
        check_sampling_key(key)
    try:
        SamplingParams(**params).verify(vocab_size)
    except ValueError as exc:
        raise SamplingError(f"SGLang refused the request: {exc}") from None


class DirectSGLangEngine:
    """final's engine dialect over `sglang.Engine`: each row is one SGLang request (its own rid, seed and
    sampling params), sent concurrently from the engine's loop thread."""

    def __init__(self, model_path: str, args: dict, vocab_size: int):
        self.vocab_size = vocab_size
        self.seeds = bool(args.get("enable_deterministic_inference"))  # see NO_SEED
        self.loop = asyncio.new_event_loop()
        self.engine: Any = None
        self.processes: list[psutil.Process] = []
        self._closed = False
        self._dead: str | None = None
        self._watch: ProcessWatch | None = None
        self._start_error: BaseException | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(model_path, args, started), daemon=True,
                                        name="final-sglang")
        self._thread.start()
        started.wait()
        if self._start_error is not None:
            self.shutdown()
            raise self._start_error
        self._watch = ProcessWatch(self._on_death, POLL_S)
        self._watch.started(self.processes)

    def _run(self, model_path: str, args: dict, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        before = {p.pid for p in psutil.Process().children()}
        try:
            with keep_event_loop_policy():
                import sglang

                self.engine = sglang.Engine(model_path=model_path, **args)
        except BaseException as exc:  # noqa: BLE001 - raised in the constructor's thread
            self._start_error = exc
        finally:
            self.processes = new_children(before)
            started.set()
        if self._start_error is None:
            self.loop.run_forever()

    # ---- the dialect ------------------------------------------------------------------------------------
    async def async_generate(self, input_ids: Any = None, sampling_params: Any = None, return_logprob: Any = False,
                             logprob_start_len: Any = None, top_logprobs_num: Any = None, cartridges: Any = None,
                             stream: bool = False, image_data: Any = None, **unsupported: Any) -> dict | list[dict]:
        if image_data is not None and any(x is not None for x in (image_data if isinstance(image_data, list)
                                                                   else [image_data])):
            raise PromptError("the sglang backend of this lane is text-only; image_data must be None")
        if unsupported or stream:
            raise SamplingError(f"not available on the sglang backend of this lane: "
                                f"{sorted(unsupported) or ['stream']}")
        single = bool(input_ids) and isinstance(input_ids[0], int)
        out = await self.submit_generate(input_ids, sampling_params, return_logprob=return_logprob,
                                         logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                                         cartridges=cartridges).wait()
        return out[0] if single else out

    def submit_generate(self, input_ids: Any, sampling_params: Any = None, *, return_logprob: Any = False,
                        logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                        cartridges: Any = None, finish: Callable[[list[dict]], Any] | None = None,
                        on_row: Callable[[int, dict], None] | None = None) -> Submission:
        """Check every row now (typed errors before anything reaches SGLang), then send them concurrently."""
        if self._closed:
            raise EngineError("the SGLang engine has been shut down")
        if self._dead:
            raise EngineError(self._dead)
        rows = [input_ids] if bool(input_ids) and isinstance(input_ids[0], int) else list(input_ids or [])
        if not rows:
            raise PromptError("input_ids must be a non-empty list of token ids or a list of such lists")
        if cartridges is not None and any(c for c in (cartridges if isinstance(cartridges, list) else [cartridges])):
            raise UnsupportedError("sglang", "cartridge", NO_CARTRIDGES)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(rows)
        requests = [self._request(i, ids, p, return_logprob, logprob_start_len, top_logprobs_num)
                    for i, (ids, p) in enumerate(zip(rows, params))]
        future = asyncio.run_coroutine_threadsafe(self._all(requests, finish, on_row), self.loop)
        rids = [r["rid"] for r in requests]
        return Submission(future, lambda: self._abort(future, rids))

    def flush_cache(self) -> bool:
        return asyncio.run_coroutine_threadsafe(self.engine.tokenizer_manager.flush_cache(), self.loop).result()

    def shutdown(self) -> None:
        """Stop this engine's processes (only those it started, unlike SGLang's own shutdown) and its thread."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.stop()
        if self.engine is not None:
            watchdog = getattr(self.engine.tokenizer_manager, "_subprocess_watchdog", None)
            if watchdog is not None:
                watchdog.stop()
        kill_processes(self.processes)
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)

    # ---- internals --------------------------------------------------------------------------------------
    def _request(self, index: int, ids: Any, params: dict, return_logprob: Any, start: int | None,
                 top: int | None) -> dict:
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in ids):
            raise PromptError("input_ids must be a non-empty list of integers", index)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:  # SGLang would index past its embedding (a device-side assert on CUDA)
            raise PromptError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})", index)
        params = dict(params)
        if params.get("n", 1) != 1:
            raise SamplingError("must be 1 per row (veRL repeats rows for n > 1)", "n")
        params.pop("n", None)
        seed = params.pop("seed", params.pop("sampling_seed", None))
        if seed is not None:
            if not self.seeds:
                raise UnsupportedError("sglang", "seed", NO_SEED)
            params["sampling_seed"] = seed
        check_sampling_params(params, self.vocab_size)
        request = {"input_ids": ids, "sampling_params": params, "return_logprob": bool(return_logprob),
                   "rid": uuid.uuid4().hex}
        if start is not None and start >= 0:
            request["logprob_start_len"] = start
        if top:
            request["top_logprobs_num"] = top
        return request

    async def _all(self, requests: list[dict], finish: Callable | None, on_row: Callable | None) -> Any:
        async def one(i: int, request: dict) -> dict:
            try:
                out = await self.engine.async_generate(**request)
            except ValueError as exc:  # SGLang's own request checks (sampling values, lengths)
                raise SamplingError(str(exc)) from None
            if on_row is not None:
                on_row(i, out)
            return out

        try:
            outputs = await gather_or_cancel([one(i, r) for i, r in enumerate(requests)])
        except asyncio.CancelledError:
            if self._dead:  # _on_death cancelled every waiting request: say why
                raise EngineError(self._dead) from None
            raise
        return finish(outputs) if finish is not None else outputs

    def _on_death(self, pid: int) -> None:
        """A process of this engine exited while serving: every waiting call ends with EngineError (SGLang would
        leave them waiting forever), and every later one is refused."""
        self._dead = f"SGLang's process {pid} exited while serving (see its log above); create a new engine."
        logger.error(self._dead)
        self.loop.call_soon_threadsafe(cancel_all, self.loop)

    def _abort(self, future: Any, rids: list[str]) -> None:
        future.cancel()
        if not self._closed:
            for rid in rids:
                self.loop.call_soon_threadsafe(self.engine.tokenizer_manager.abort_request, rid)


class DirectSGLangRollout(EngineRollout):
    name = "sglang"
    # streaming stays False (Capabilities' default): token streams are not bridged, astream yields whole rows
    capabilities = Capabilities(cartridges=False, tools=True, tool_events=True, notes=(("cartridge", NO_CARTRIDGES),))

    @classmethod
    def preflight(cls, engine_config: Any) -> None:
        preflight(engine_config)

    def __init__(self, config: Any, model_config: Any):
        device = sglang_device(config.engine_kwargs)
        require_sglang(device)
        survive_sigquit()  # SGLang's watchdog SIGQUITs this process when a child dies (main thread only: else no-op)
        args = server_args(config, device)
        if not args.get("enable_deterministic_inference"):
            # SGLang 0.5.12 reads a request's sampling_seed only under deterministic inference (sampling_batch_info
            # builds the seeds only then): without it a seed would be silently ignored, so it is refused instead
            self.capabilities = dataclasses.replace(self.capabilities, seed=False,
                                                    notes=self.capabilities.notes + (("seed", NO_SEED),))
        engine = DirectSGLangEngine(model_config.local_path, args, model_config.hf_config.vocab_size)
        super().__init__(config, model_config, engine)

    async def resume(self, tags: list[str]) -> None:
        """SGLang keeps its KV pool and weights; nothing was released."""

    async def release(self) -> None:
        """Nothing is released on this lane (no memory saver): the engine keeps serving."""

    async def update_weights(self, weights: Any, **kwargs: Any) -> None:
        raise BackendUnavailableError("weight updates into SGLang 0.5.12 are veRL 0.9's own path (its ServerAdapter); "
                                      "final's sglang backend on the verl09 lane serves fixed weights")


def build(engine_config: Any, rollout_config: Any, model_config: Any) -> DirectSGLangRollout:
    return DirectSGLangRollout(rollout_config, model_config)
