"""rollout.name: sglang — veRL 0.6.0's own SGLangRollout, which runs an in-process SGLang 0.5.2 engine.

veRL's class expects to live in a Ray worker. What this module supplies at world size 1:
- requirements: CUDA and the sglang package, else BackendUnavailableError with the install command;
- the process: a process group (final.process_group: gloo, or cpu:gloo,cuda:nccl), WORLD_SIZE/RANK/LOCAL_RANK/MASTER_*,
  the visible-devices variable veRL reads, torch.cuda.set_device; free SGLang/NCCL ports per engine;
- config translation (config.py): tp=1, token in/token out, the attention backend (fa3 on sm80-sm90, else
  flashinfer or triton with a warning), the GPU from LOCAL_RANK, no memory saver by default, one GPU per engine,
  engine_kwargs.sglang handed to SGLang's ServerArgs (veRL 0.6.0 drops them);
- one owner thread with its own event loop (final.rollout.thread): SGLang binds to the loop of its first request
  and veRL calls run_until_complete, which a running loop (Jupyter) refuses. The engine is built and every call
  runs on that thread, so generate works from scripts, other threads and notebook cells;
- lifecycle: shutdown() kills this engine's processes, closes its sockets, destroys the group with the last
  engine; context manager; atexit. A scheduler that dies (SGLang SIGQUITs the parent, which would kill it)
  turns into EngineError for the caller instead of a dead process or a hang.
- cartridges (cartridges.py, scheduler.py).

SGLang starts its scheduler with multiprocessing's `spawn`, which re-imports the main script in the child: a
script must create the engine under `if __name__ == "__main__":` (the unguarded case is detected and named).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import concurrent.futures.thread  # noqa: F401 - its exit hook, before SGLang disables threading._register_atexit
import contextlib
import importlib.util
import logging
import multiprocessing as mp
import os
import threading
from typing import Any, Callable, TypeVar

import torch

from final import process_group as dist
from final.adapters import FolderBase, MergedAdapter, lora_keywords
from final.errors import EngineError
from final.rollout.base import Backend, Capabilities, Observer, check_constrained_calls, constraint_notes
from final.rollout.sglang.config import (NO_GRAMMAR, UNSERVED_BY_052, check_applied_defaults, check_sampling_kwargs, preflight,
                                        refusing, require_sglang, sglang_device, translate_config, unserved_keys)
from final.rollout.sglang.procs import POLL_S, ProcessWatch, cancel_all, release_start, survive_sigquit
from final.rollout.sglang.weights import contiguous, share_tensors_safely
from final.rollout.thread import RolloutThread
from final.weights import check_update, hf_parameter_shapes

logger = logging.getLogger(__name__)
T = TypeVar("T")

ADAPTERS_052 = ("SGLang 0.5.2's LoRA runs on its triton kernels (CUDA) only and veRL 0.6.0's SGLangRollout sends no "
                "lora_path: serve an adapter merged (update_weights with the adapter) or on the local backend")
SPAWN_GUARD = ("SGLang starts its scheduler with multiprocessing 'spawn', which re-imports your main script; this "
               "process is that re-import. Create the engine under `if __name__ == \"__main__\":`.")

_group_users = 0  # live engines; the process group goes with the last one
_group_lock = threading.Lock()


# ---- the process ---------------------------------------------------------------------------------------
def _prepare_env(device: str, gpu: int) -> list[str]:
    """Set the visible-devices variable veRL reads (when absent) and the CUDA device; return what we set."""
    from verl.utils.device import get_visible_devices_keyword

    key = get_visible_devices_keyword()  # CUDA_VISIBLE_DEVICES, or ASCEND_RT_VISIBLE_DEVICES without CUDA
    ours = []
    if key not in os.environ:
        count = torch.cuda.device_count() if device != "cpu" else 1
        os.environ[key] = ",".join(str(i) for i in range(max(count, 1)))
        ours.append(key)
    if device != "cpu":  # pragma: no cover - CUDA only
        torch.cuda.set_device(gpu)  # the GPU SGLang's scheduler gets too (ServerArgs.base_gpu_id)
    return ours


def _group_env() -> list[str]:
    """veRL reads WORLD_SIZE and RANK from the environment; a caller's own process group (init_method tcp://...)
    may have been made without them. Take them from the group; return what we set."""
    import torch.distributed as tdist

    ours = []
    for key, value in (("WORLD_SIZE", tdist.get_world_size()), ("RANK", tdist.get_rank())):
        if key not in os.environ:
            os.environ[key] = str(value)
            ours.append(key)
    return ours


def _cuda_capability(device: str) -> tuple[int, int] | None:
    if device == "cpu":
        return None
    return tuple(torch.cuda.get_device_capability())  # pragma: no cover - CUDA only


# ---- the rollout ------------------------------------------------------------------------------------------
class SGLangRollout(Backend):
    """veRL 0.6.0's SGLangRollout with an in-process SGLang 0.5.2 engine, usable from any thread or event loop."""

    name = "sglang"
    # SGLang 0.5.2 has no per-request seed; veRL's calls report no per-row progress or live tool events (the calls
    # a row made are in its metadata: engine_052 records them around the tools' execute)
    capabilities = Capabilities(seed=False, cartridges=True, tools=True, notes=(
        ("seed", "SGLang 0.5.2 has no per-request seed: set rollout.engine_kwargs.sglang.random_seed"),
        ("max_turns", "veRL 0.6.0's SGLangRollout runs only the tools of rollout.multi_turn.tool_config_path, "
                      "built when it starts; a call's own tools are offered and parsed (no max_turns), or run them "
                      "on the local backend or the verl09 lane's sglang"),
        *constraint_notes(f"{NO_GRAMMAR} (the verl06 lane)"),
        ("adapter", ADAPTERS_052)))

    @classmethod
    def preflight(cls, engine_config: Any) -> None:
        unserved = unserved_keys(engine_config.rollout.get("engine_kwargs"), UNSERVED_BY_052)
        check_applied_defaults(engine_config.rollout, unserved, engine_config.source)
        preflight(engine_config)

    def __init__(self, config: Any, model_config: Any):
        global _group_users
        super().__init__(config, model_config, None)
        check_constrained_calls(self.name, self.capabilities, config)
        device = sglang_device(config.engine_kwargs)
        require_sglang(device)
        if getattr(mp.current_process(), "_inheriting", False):
            raise EngineError(SPAWN_GUARD)
        have_flashinfer = importlib.util.find_spec("flashinfer") is not None
        gpus = torch.cuda.device_count() if device != "cpu" else 1
        self.config, server_args = translate_config(config, _cuda_capability(device), have_flashinfer, gpus)
        self._unserved = unserved_keys(config.engine_kwargs, UNSERVED_BY_052)
        self.capabilities = refusing(self.capabilities, self._unserved)
        self.device = device
        self._model_dir = model_config.local_path
        self.merged = MergedAdapter(FolderBase(self._model_dir))  # a trainer's adapter, sent as merged weights
        self._dead: str | None = None
        self._closed = False
        self._rollout = None
        self._env = _prepare_env(device, server_args["base_gpu_id"])
        with _group_lock:
            dist.ensure_process_group()
            _group_users += 1
        self._env += _group_env()
        survive_sigquit()
        self._thread = RolloutThread("final-sglang")
        self._thread_ident = self._thread.run(threading.get_ident)
        self._watch = ProcessWatch(self._on_death, POLL_S, self._thread_ident)
        atexit.register(self.shutdown)
        try:
            from final.rollout.sglang.engine_052 import InProcessSGLangRollout

            self._rollout = self._call(lambda: InProcessSGLangRollout(self.config, model_config, server_args))
            self._watch.started(self._rollout.engine.processes)
        except BaseException:
            self.shutdown()
            raise

    # ---- generation -----------------------------------------------------------------------------------
    def generate_sequences(self, prompts: Any, *, observer: Observer | None = None, **kwargs: Any) -> Any:
        """veRL's generate_sequences (DataProto in, DataProto out), run on the engine's thread."""
        check_sampling_kwargs(kwargs, self._unserved)
        return _rows_done(self._call(lambda: self._rollout.generate_sequences(prompts, **kwargs)), observer)

    async def agenerate_sequences(self, prompts: Any, *, observer: Observer | None = None, **kwargs: Any) -> Any:
        """Awaitable generate_sequences: the caller's event loop keeps running meanwhile."""
        check_sampling_kwargs(kwargs, self._unserved)
        fut = asyncio.wrap_future(self._submit(lambda: self._rollout.generate_sequences(prompts, **kwargs)))
        await asyncio.wait({fut})
        return _rows_done(self._result(fut.result), observer)

    def tool_schemas(self) -> list[dict]:
        """veRL's own tool list (built from rollout.multi_turn.tool_config_path at start)."""
        tools = self._call(lambda: list(getattr(self._rollout, "_tool_map", {}).values()))
        return [tool.get_openai_tool_schema().model_dump() for tool in tools]

    async def resume(self, tags: list[str]) -> None:
        self._call(lambda: self._thread.loop.run_until_complete(self._rollout.resume(tags)))

    async def release(self) -> None:
        self._call(lambda: self._thread.loop.run_until_complete(self._rollout.release()))

    async def update_weights(self, weights: Any, **kwargs: Any) -> None:
        """veRL's own SGLangRollout.update_weights (buckets through SGLang's update_weights_from_tensor, then a
        radix-cache flush, which re-injects loaded cartridges), after the whole update is checked against the
        model's HF parameters: a refused update reaches SGLang not at all. LoRA tensors are merged here into their
        modules' bases (final/adapters/merge.py) and sent as those modules' weights: veRL 0.6.0's class would
        pass them to SGLang under names it does not know."""
        shapes = hf_parameter_shapes(self._model_dir)
        plan = self.merged.plan(weights, shapes, **lora_keywords(kwargs))
        named = contiguous(check_update(plan.named, shapes), self.device)
        share_tensors_safely()
        rest = {k: v for k, v in kwargs.items() if k not in ("peft_config", "base_sync_done")}
        self._call(lambda: self._thread.loop.run_until_complete(self._rollout.update_weights(iter(named), **rest)))
        plan.commit()

    # ---- cartridges (EmbeddedEngine's interface) --------------------------------------------------------
    def load_cartridge(self, cartridge_id: str, keys: list[torch.Tensor], values: list[torch.Tensor]) -> int:
        """Inject a cartridge (per-layer K/V [1,Hkv,T,D] or [Hkv,T,D], post-RoPE); an id already loaded is
        replaced. Returns its length."""
        return self._call(lambda: self._rollout.engine.cartridges.load_cartridge(cartridge_id, keys, values))

    def unload_cartridge(self, cartridge_id: str) -> bool:
        return self._call(lambda: self._rollout.engine.cartridges.unload_cartridge(cartridge_id))

    def cartridge_ids(self) -> list[str]:
        return self._call(lambda: self._rollout.engine.cartridges.cartridge_ids())

    def cartridge_memory(self) -> dict:
        """Where the scheduler keeps cartridge KV (see SGLangCartridges.memory): host copies, pool slots."""
        return self._call(lambda: self._rollout.engine.cartridges.memory())

    # ---- lifecycle --------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine: its processes, sockets, thread; the process group with the last engine. Idempotent."""
        global _group_users
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        engine = self._rollout.engine if self._rollout is not None else None
        idle = self._thread_idle()
        try:
            if engine is not None and idle:
                self._thread.submit(engine.cancel_tasks).result(timeout=30)
        finally:
            if engine is not None:
                engine.shutdown()
        if idle:
            self._thread.close()
        self._watch.stop()
        with _group_lock:
            _group_users -= 1
            if _group_users == 0:
                dist.destroy_process_group()
        for key in self._env:
            os.environ.pop(key, None)
        if self.device != "cpu":  # pragma: no cover - CUDA only
            torch.cuda.empty_cache()

    def __enter__(self) -> "SGLangRollout":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    @property
    def sglang_engine(self) -> Any:
        """The FinalSGLangEngine (an sglang Engine); call it only through this object's thread."""
        return self._rollout.engine

    @property
    def pad_token_id(self) -> int:
        return self._rollout.pad_token_id

    @property
    def cartridge_target(self) -> "SGLangRollout":
        """What CartridgeService drives: load_cartridge / unload_cartridge, as on the embedded engine."""
        return self

    # ---- internals --------------------------------------------------------------------------------------
    def _thread_idle(self) -> bool:
        """Whether the owner thread takes work (after a death it may be stuck inside SGLang's start)."""
        try:
            self._thread.submit(lambda: None).result(timeout=5 if self._dead else None)
            return True
        except (concurrent.futures.TimeoutError, RuntimeError):  # stuck, or stopped by the interpreter's exit
            return False

    def _submit(self, fn: Callable[[], T]) -> concurrent.futures.Future:
        if self._closed:
            raise EngineError("the SGLang engine has been shut down")
        if self._dead:
            raise EngineError(self._dead)
        return self._thread.submit(fn)

    def _call(self, fn: Callable[[], T]) -> T:
        """Run fn on the owner thread. Every place SGLang can wait there ends when its scheduler dies (the
        death notice cancels the loop's tasks, closes the start pipe; cartridge RPCs poll), so this returns."""
        return self._result(self._submit(fn).result)

    def _result(self, get: Callable[[], T]) -> T:
        try:
            return get()
        except BaseException as exc:  # CancelledError included: a death notice cancels what was waiting
            if self._dead and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise EngineError(self._dead) from exc  # whatever broke inside SGLang, the cause is the death
            raise

    def _on_death(self, pid: int) -> None:
        if self._rollout is None:
            self._dead = (f"SGLang's process {pid} exited while starting (see its log above). If the log shows "
                          f"this error in a re-imported script, create the engine under "
                          f"`if __name__ == \"__main__\":`.")
        else:
            self._dead = f"SGLang's process {pid} exited while serving (see its log above); create a new engine."
        logger.error(self._dead)
        release_start(self._thread_ident)
        with contextlib.suppress(RuntimeError):  # the loop may close under us during shutdown
            self._thread.loop.call_soon_threadsafe(cancel_all, self._thread.loop)  # a waiting call ends


def _rows_done(output: Any, observer: Observer | None) -> Any:
    """veRL's batch call is one engine call: every row finishes together."""
    if observer is not None:
        for _ in range(len(output)):
            observer.row_done()
    return output


def build(engine_config: Any, rollout_config: Any, model_config: Any) -> SGLangRollout:
    """final.rollout registry factory (InferenceEngine runs preflight() on the caller's thread first)."""
    return SGLangRollout(rollout_config, model_config)
