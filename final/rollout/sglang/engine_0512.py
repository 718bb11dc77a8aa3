"""DirectSGLangEngine: final's engine dialect (final/engine/engine.py) over SGLang 0.5.12's `sglang.Engine`.

Each row is one SGLang request (its own rid, seed, sampling params and cartridge prefix), sent from the engine's own
thread and event loop (SGLang binds to the loop of its first request), so calls from any thread or loop overlap
there. What the dialect adds to SGLang's Engine:
- typed errors before anything reaches SGLang (token ids, SamplingParams' own checks, cartridges, context);
- cartridges (cartridges.py, scheduler.py): a row naming cartridges is sent as R + prompt, R its reserved ids, whose
  KV the scheduler injected into the radix cache; every answer is checked to have been served from the cache.
  `FinalEngine` is SGLang's Engine with the scheduler child running final's `run_scheduler_process` (0.5.12 lets a
  subclass name it; 0.5.2 needed a patch of the engine module);
- token streams: `async_generate(..., stream=True)` returns an async iterator on the caller's loop, fed from
  SGLang's stream on the engine loop (cumulative output ids, SGLang's default without incremental_streaming_output),
  one update per token: SGLang hands a slow reader only its latest state, so several tokens arrive as one update;
- the engine's own processes only: SGLang's Engine.shutdown kills every child of the process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures.thread  # noqa: F401 - its exit hook, before SGLang disables threading._register_atexit
import contextlib
import logging
import threading
import uuid
from typing import Any, AsyncIterator, Callable

import psutil

from final.engine.messages import Submission
from final.errors import EngineError, PromptError, SamplingError, UnsupportedError
from final.rollout.sglang.cartridges import SGLangCartridges, check_prefix_hit, flush_until_idle, shift_starts
from final.rollout.sglang.config import check_sampling_key, refuse_constraints
from final.rollout.sglang.procs import (POLL_S, ProcessWatch, cancel_all, keep_event_loop_policy, kill_processes,
                                        new_children)
from final.rollout.thread import gather_or_cancel

logger = logging.getLogger(__name__)

NO_SEED = ("SGLang 0.5.12 honours a per-request seed only with deterministic inference: set "
           "rollout.engine_kwargs.sglang.enable_deterministic_inference: true (batch-invariant kernels, slower)")


def check_sampling_params(params: dict, vocab_size: int) -> None:
    """SGLang's own SamplingParams checks, run here so a bad value is a SamplingError naming the key before any
    request reaches the engine (SGLang raises TypeError / ValueError from its tokenizer manager)."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    refuse_constraints(params)
    for key in params:
        check_sampling_key(key)
    try:
        SamplingParams(**params).verify(vocab_size)
    except ValueError as exc:
        raise SamplingError(f"SGLang refused the request: {exc}") from None


def engine_class() -> type:
    """sglang.Engine whose scheduler child adds final's cartridge RPCs (scheduler.py) before it serves."""
    from sglang.srt.entrypoints.engine import Engine  # `sglang.Engine` is a LazyImport, not a class to subclass

    from final.rollout.sglang import scheduler

    class FinalEngine(Engine):
        run_scheduler_process_func = staticmethod(scheduler.run_scheduler_process)

    return FinalEngine


class DirectSGLangEngine:
    def __init__(self, model_path: str, args: dict, vocab_size: int):
        self.vocab_size = vocab_size
        self.seeds = bool(args.get("enable_deterministic_inference"))  # see NO_SEED
        self.loop = asyncio.new_event_loop()
        self.engine: Any = None
        self.cartridges: SGLangCartridges | None = None  # set by the rollout once it has the tokenizer
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
                self.engine = engine_class()(model_path=model_path, **args)
        except BaseException as exc:  # noqa: BLE001 - raised in the constructor's thread
            self._start_error = exc
        finally:
            self.processes = new_children(before)
            started.set()
        if self._start_error is None:
            self.loop.run_forever()

    @property
    def send_to_rpc(self) -> Any:
        """SGLang's RPC socket to the scheduler (SGLangCartridges sends its cartridge RPCs there)."""
        return self.engine.send_to_rpc

    # ---- the dialect ------------------------------------------------------------------------------------
    async def async_generate(self, input_ids: Any = None, sampling_params: Any = None, return_logprob: Any = False,
                             logprob_start_len: Any = None, top_logprobs_num: Any = None, cartridges: Any = None,
                             stream: bool = False, image_data: Any = None, **unsupported: Any) -> Any:
        """One prompt (a list of ids) -> one dict, several -> a list; stream=True (one prompt, n=1) -> an async
        iterator of dicts with the cumulative output_ids, the last with its finish_reason."""
        if image_data is not None and any(x is not None for x in (image_data if isinstance(image_data, list)
                                                                   else [image_data])):
            raise PromptError("the sglang backend of this lane is text-only; image_data must be None")
        if unsupported:
            raise SamplingError(f"not available on the sglang backend of this lane: {sorted(unsupported)}")
        single = bool(input_ids) and isinstance(input_ids[0], int)
        if stream:
            if not single or (sampling_params or {}).get("n", 1) != 1:
                raise SamplingError("streaming takes one prompt with n=1", "stream")
            request, plen = self._plan([input_ids], [sampling_params or {}], return_logprob, logprob_start_len,
                                       top_logprobs_num, cartridges)[0]
            return self._stream(request, plen)
        out = await self.submit_generate(input_ids, sampling_params, return_logprob=return_logprob,
                                         logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                                         cartridges=cartridges).wait()
        return out[0] if single else out

    def submit_generate(self, input_ids: Any, sampling_params: Any = None, *, return_logprob: Any = False,
                        logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                        cartridges: Any = None, finish: Callable[[list[dict]], Any] | None = None,
                        on_row: Callable[[int, dict], None] | None = None) -> Submission:
        """Check every row now (typed errors before anything reaches SGLang), then send them concurrently."""
        rows = [input_ids] if bool(input_ids) and isinstance(input_ids[0], int) else list(input_ids or [])
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(rows)
        planned = self._plan(rows, params, return_logprob, logprob_start_len, top_logprobs_num, cartridges)
        future = asyncio.run_coroutine_threadsafe(self._all(planned, finish, on_row), self.loop)
        rids = [r["rid"] for r, _ in planned]
        return Submission(future, lambda: self._abort(future, rids))

    async def flush_cache(self) -> bool:
        """Empty the radix cache (SGLang refuses while requests run); the scheduler re-injects loaded cartridges.
        A coroutine, as SGLang's own: the multi-turn path awaits it on the caller's loop, which keeps serving while
        the engine loop flushes (retries included)."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._flush(), self.loop))

    def flush_cache_blocking(self) -> bool:
        """flush_cache for a caller off any event loop (a weight update on the rollout's thread)."""
        return asyncio.run_coroutine_threadsafe(self._flush(), self.loop).result()

    async def _flush(self) -> bool:  # on the engine loop
        retired = self.cartridges.retired() if self.cartridges is not None else []
        ok = (await flush_until_idle(self.engine.tokenizer_manager.flush_cache)).success
        if ok and self.cartridges is not None:
            self.cartridges.after_flush(retired)
        return ok

    def update_weights(self, named: list, version: int | None = None) -> None:
        """Checked tensors into the scheduler's model (SGLang's update_weights_from_tensor, on the engine loop),
        then our flush (the radix cache goes; loaded cartridges are injected again)."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        request = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[MultiprocessingSerializer.serialize(named)], flush_cache=False,
            weight_version=None if version is None else str(version))
        update = self.engine.tokenizer_manager.update_weights_from_tensor(request, None)
        success, message = asyncio.run_coroutine_threadsafe(update, self.loop).result()
        if not success:
            raise EngineError(f"SGLang refused the weight update: {message}")
        if not self.flush_cache_blocking():
            raise EngineError("SGLang updated the weights but could not flush its radix cache (requests running)")

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
        if self.cartridges is not None:
            self.cartridges.close()

    # ---- a call's rows ----------------------------------------------------------------------------------
    def _plan(self, rows: list, params: list, return_logprob: Any, start: Any, top: int | None,
              cartridges: Any) -> list[tuple[dict, int]]:
        """(SGLang request, cartridge prefix length) per row, every check done."""
        if self._closed:
            raise EngineError("the SGLang engine has been shut down")
        if self._dead:
            raise EngineError(self._dead)
        if not rows:
            raise PromptError("input_ids must be a non-empty list of token ids or a list of such lists")
        for i, ids in enumerate(rows):
            self._check_ids(i, ids)
        wanted = cartridges if isinstance(cartridges, list) else [cartridges] * len(rows)
        if any(wanted) and self.cartridges is None:
            raise UnsupportedError("sglang", "cartridge", "this engine was started without cartridge support")
        prefixes = [[] for _ in rows]
        if self.cartridges is not None and (any(wanted) or self.cartridges.active()):
            prefixes = self.cartridges.prefixes(rows, wanted, params, self.engine.tokenizer_manager.context_len)
        starts = shift_starts(start, prefixes)
        return [(self._request(p, prefix + list(ids), return_logprob, s, top), len(prefix))
                for ids, p, prefix, s in zip(rows, params, prefixes, starts)]

    def _check_ids(self, index: int, ids: Any) -> None:
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in ids):
            raise PromptError("input_ids must be a non-empty list of integers", index)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:  # SGLang would index past its embedding (a device-side assert on CUDA)
            raise PromptError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})", index)

    def _request(self, params: dict, ids: list[int], return_logprob: Any, start: int, top: int | None) -> dict:
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
        if start >= 0:
            request["logprob_start_len"] = start
        if top:
            request["top_logprobs_num"] = top
        return request

    async def _all(self, planned: list[tuple[dict, int]], finish: Callable | None, on_row: Callable | None) -> Any:
        async def one(i: int, request: dict, plen: int) -> dict:
            try:
                out = await self.engine.async_generate(**request)
            except ValueError as exc:  # SGLang's own request checks (sampling values, lengths)
                raise SamplingError(str(exc)) from None
            check_prefix_hit(out, plen)
            if on_row is not None:
                on_row(i, out)
            return out

        try:
            outputs = await gather_or_cancel([one(i, r, plen) for i, (r, plen) in enumerate(planned)])
        except asyncio.CancelledError:
            if self._dead:  # _on_death cancelled every waiting request: say why
                raise EngineError(self._dead) from None
            raise
        return finish(outputs) if finish is not None else outputs

    # ---- streams ----------------------------------------------------------------------------------------
    async def _stream(self, request: dict, plen: int) -> AsyncIterator[dict]:
        """SGLang's stream, read on the engine loop and handed to this (the caller's) loop one update at a time.
        Closing this iterator early aborts the request."""
        caller, queue = asyncio.get_running_loop(), asyncio.Queue()

        def hand(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the caller's loop closed: nobody is reading
                caller.call_soon_threadsafe(queue.put_nowait, item)

        future, handed = asyncio.run_coroutine_threadsafe(self._pump(request, hand), self.loop), 0
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                if (item["meta_info"].get("finish_reason") or {}).get("type"):
                    check_prefix_hit(item, plen)
                for update in per_token(item, handed):
                    yield update
                handed = len(item["output_ids"])
        finally:
            if not future.done():
                self._abort(future, [request["rid"]])

    async def _pump(self, request: dict, hand: Callable[[Any], None]) -> None:
        try:
            async for out in await self.engine.async_generate(**request, stream=True):
                # Until it finishes, SGLang hands out its own growing list: copy it here, on the loop that grows it
                hand({**out, "output_ids": list(out["output_ids"]),
                      "meta_info": {k: list(v) if isinstance(v, list) else v for k, v in out["meta_info"].items()}})
        except asyncio.CancelledError:
            hand(EngineError(self._dead) if self._dead else asyncio.CancelledError())
        except ValueError as exc:  # SGLang's own request checks
            hand(SamplingError(str(exc)))
        except Exception as exc:  # noqa: BLE001 - handed to the caller's loop
            hand(exc)
        finally:
            hand(None)

    # ---- failures ---------------------------------------------------------------------------------------
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


def per_token(item: dict, handed: int) -> list[dict]:
    """One cumulative stream update -> one update per token it adds past `handed` (SGLang's tokenizer manager gives a
    reader that fell behind only the latest state, so a slow consumer would see 2+ tokens at once). Each keeps the
    per-token meta lists (logprobs, top logprobs) cut to its length; only the last keeps the finish reason."""
    ids, meta = item["output_ids"], item["meta_info"]
    if len(ids) <= handed + 1:
        return [item]
    cut = [k for k, v in meta.items() if isinstance(v, list) and len(v) == len(ids)]
    updates = [{**item, "output_ids": ids[:n],
                "meta_info": {**meta, **{k: meta[k][:n] for k in cut}, "finish_reason": None, "completion_tokens": n}}
               for n in range(handed + 1, len(ids))]
    return updates + [item]
