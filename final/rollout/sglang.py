"""rollout.name: sglang — veRL 0.6.0's own SGLangRollout, which runs an in-process SGLang 0.5.2 engine.

veRL's class expects to live in a Ray worker. What this module supplies at world size 1:
- requirements: CUDA and the sglang package, else BackendUnavailableError with the install command;
- the process: a process group (final.dist: gloo, or cpu:gloo,cuda:nccl), WORLD_SIZE/RANK/LOCAL_RANK/MASTER_*,
  the visible-devices variable veRL reads, torch.cuda.set_device; free SGLang/NCCL ports per engine;
- config translation: tp=1, token in/token out, the attention backend (fa3 on sm80-sm90, else flashinfer or
  triton with a warning), engine_kwargs.sglang handed to SGLang's ServerArgs (veRL 0.6.0 drops them);
- one owner thread with its own event loop (final.rollout.thread): SGLang binds to the loop of its first request
  and veRL calls run_until_complete, which a running loop (Jupyter) refuses. The engine is built and every call
  runs on that thread, so generate works from scripts, other threads and notebook cells;
- lifecycle: shutdown() kills this engine's processes, closes its sockets, destroys the group with the last
  engine; context manager; atexit. A scheduler that dies (SGLang SIGQUITs the parent, which would kill it)
  turns into EngineError for the caller instead of a dead process or a hang.
- cartridges (sglang_cartridges.py, sglang_scheduler.py).

SGLang starts its scheduler with multiprocessing's `spawn`, which re-imports the main script in the child: a
script must create the engine under `if __name__ == "__main__":` (the unguarded case is detected and named).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import concurrent.futures.thread  # noqa: F401 - its exit hook, before SGLang disables threading._register_atexit
import contextlib
import dataclasses
import difflib
import importlib.util
import inspect
import logging
import multiprocessing as mp
import os
import threading
from typing import Any, Callable, TypeVar

import torch

from final import dist
from final.errors import BackendUnavailableError, ConfigError, EngineError, SamplingError
from final.rollout.base import Backend, Capabilities, Observer
from final.rollout.sglang_procs import ProcessWatch, release_start, survive_sigquit
from final.rollout.thread import RolloutThread

logger = logging.getLogger(__name__)
T = TypeVar("T")

INSTALL = "pip install -e '.[sglang]'"
SPAWN_GUARD = ("SGLang starts its scheduler with multiprocessing 'spawn', which re-imports your main script; this "
               "process is that re-import. Create the engine under `if __name__ == \"__main__\":`.")
# ServerArgs the rollout config already decides: engine_kwargs.sglang may not override them.
OWNED_SERVER_ARGS = {
    "model_path": "model_path", "tokenizer_path": "tokenizer_path", "trust_remote_code": "trust_remote_code",
    "tp_size": "rollout.tensor_model_parallel_size", "dtype": "rollout.dtype",
    "mem_fraction_static": "rollout.gpu_memory_utilization", "load_format": "rollout.load_format",
    "skip_tokenizer_init": "rollout.skip_tokenizer_init", "max_running_requests": "rollout.max_num_seqs",
    "mm_attention_backend": "rollout.engine_kwargs.sglang.attention_backend",
}
POLL_S = 0.5  # how often the process watch looks at the engine's processes

_group_users = 0  # live engines; the process group goes with the last one
_group_lock = threading.Lock()


# ---- requirements and config ----------------------------------------------------------------------------
def missing_requirements(cuda: bool, sglang: bool, device: str = "cuda") -> list[str]:
    """What keeps SGLang from running: a CUDA GPU (unless SGLang's CPU device is chosen) and the package."""
    missing = []
    if device != "cpu" and not cuda:
        missing.append("a CUDA GPU (torch.cuda.is_available() is False)")
    if not sglang:
        missing.append("the sglang package (sglang[srt]==0.5.2)")
    return missing


def require_sglang(device: str = "cuda") -> None:
    """Raise BackendUnavailableError naming what is missing and how to install it."""
    missing = missing_requirements(torch.cuda.is_available(), importlib.util.find_spec("sglang") is not None, device)
    if missing:
        raise BackendUnavailableError(
            f"rollout.name: sglang needs {' and '.join(missing)}. On a CUDA 12 machine: {INSTALL} (SGLang 0.5.2 "
            f"and torch 2.8, as veRL 0.6.0 pins them). Without a GPU use rollout.name: local or auto.")


def preflight(engine_config: Any) -> None:
    """What InferenceEngine runs first when rollout.name resolves to sglang, on the caller's thread: the
    requirements check (before any model download) and SIGQUIT survival (only the main thread can set it)."""
    sglang_kwargs = (engine_config.rollout.get("engine_kwargs") or {}).get("sglang") or {}
    require_sglang(sglang_kwargs.get("device") or "cuda")
    survive_sigquit()


def choose_attention_backend(requested: str | None, capability: tuple[int, int] | None,
                             have_flashinfer: bool) -> tuple[str, str | None]:
    """(backend, warning or None). SGLang 0.5.2's fa3 backend needs sm80-sm90 ("FlashAttention v3 Backend requires
    SM>=80 and SM<=90"): the default there, elsewhere flashinfer (or triton) with a warning. capability None means
    SGLang's CPU device, whose backend is intel_amx."""
    fa3_ok = capability is not None and (8, 0) <= capability < (10, 0)
    if requested:
        if requested == "fa3" and capability is not None and not fa3_ok:
            raise ConfigError(f"fa3 needs an Ampere or Hopper GPU (sm80-sm90); this GPU is sm{capability[0]}"
                              f"{capability[1]}: use flashinfer or triton",
                              key="rollout.engine_kwargs.sglang.attention_backend")
        return requested, None
    if capability is None:
        return "intel_amx", None
    if fa3_ok:
        return "fa3", None
    fallback = "flashinfer" if have_flashinfer else "triton"
    return fallback, (f"fa3 (FlashAttention 3) needs an sm80-sm90 GPU and this one is sm{capability[0]}"
                      f"{capability[1]}: using the {fallback} attention backend. Set "
                      f"rollout.engine_kwargs.sglang.attention_backend to choose another.")


def translate_config(config: Any, capability: tuple[int, int] | None, have_flashinfer: bool) -> tuple[Any, dict]:
    """RolloutConfig -> (the RolloutConfig veRL gets, extra ServerArgs for the engine)."""
    from sglang.srt.server_args import ServerArgs

    if config.tensor_model_parallel_size != 1:
        raise ConfigError(f"must be 1 (one in-process engine), got {config.tensor_model_parallel_size}",
                          key="rollout.tensor_model_parallel_size")
    if not config.skip_tokenizer_init:
        raise ConfigError("must be true: prompts reach SGLang as token ids", key="rollout.skip_tokenizer_init")
    if config.load_format.startswith("dummy"):
        logger.warning("rollout.load_format is %r: SGLang starts with random weights", config.load_format)
    extra = {k: v for k, v in ((config.engine_kwargs or {}).get("sglang") or {}).items() if v is not None}
    backend, warning = choose_attention_backend(extra.pop("attention_backend", None), capability, have_flashinfer)
    if warning:
        logger.warning(warning)
    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    for key in extra:
        where = f"rollout.engine_kwargs.sglang.{key}"
        if key in OWNED_SERVER_ARGS:
            raise ConfigError(f"is set by {OWNED_SERVER_ARGS[key]}; set it there", key=where)
        if key not in fields:
            near = difflib.get_close_matches(key, sorted(fields), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"is not an SGLang 0.5.2 ServerArgs field{hint}", key=where)
    server_args = {"port": dist.free_port(), "nccl_port": dist.free_port(), **extra}
    engine_kwargs = {**(config.engine_kwargs or {}), "sglang": {"attention_backend": backend}}
    return dataclasses.replace(config, engine_kwargs=engine_kwargs), server_args


def check_sampling_kwargs(kwargs: dict) -> None:
    """Per-call overrides become SGLang SamplingParams(**params): refuse what 0.5.2 would reject, by name."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    allowed = set(inspect.signature(SamplingParams.__init__).parameters) - {"self"}
    for key in kwargs:
        if key == "seed":
            raise SamplingError("SGLang 0.5.2 has no per-request seed; set rollout.engine_kwargs.sglang.random_seed",
                                key)
        if key not in allowed:
            raise SamplingError(f"is not an SGLang 0.5.2 sampling parameter ({', '.join(sorted(allowed))})", key)


# ---- the process ---------------------------------------------------------------------------------------
def _prepare_env(device: str) -> list[str]:
    """Set the visible-devices variable veRL reads (when absent) and the CUDA device; return what we set."""
    from verl.utils.device import get_visible_devices_keyword

    key = get_visible_devices_keyword()  # CUDA_VISIBLE_DEVICES, or ASCEND_RT_VISIBLE_DEVICES without CUDA
    ours = []
    if key not in os.environ:
        count = torch.cuda.device_count() if device != "cpu" else 1
        os.environ[key] = ",".join(str(i) for i in range(max(count, 1)))
        ours.append(key)
    if device != "cpu":  # pragma: no cover - CUDA only
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return ours


def _cuda_capability(device: str) -> tuple[int, int] | None:
    if device == "cpu":
        return None
    return tuple(torch.cuda.get_device_capability())  # pragma: no cover - CUDA only


# ---- the rollout ------------------------------------------------------------------------------------------
class SGLangRollout(Backend):
    """veRL 0.6.0's SGLangRollout with an in-process SGLang 0.5.2 engine, usable from any thread or event loop."""

    name = "sglang"
    # veRL's batch call is one engine call per DataProto and flushes SGLang's cache after it: calls run one at a
    # time; SGLang 0.5.2 has no per-request seed; with skip_tokenizer_init its scheduler cannot match stop strings
    capabilities = Capabilities(seed=False, stop_strings=False, cartridges=True, tools=True, concurrent=False)

    @classmethod
    def preflight(cls, engine_config: Any) -> None:
        preflight(engine_config)

    def __init__(self, config: Any, model_config: Any):
        global _group_users
        super().__init__(config, model_config, None)
        device = ((config.engine_kwargs or {}).get("sglang") or {}).get("device") or "cuda"
        require_sglang(device)
        if getattr(mp.current_process(), "_inheriting", False):
            raise EngineError(SPAWN_GUARD)
        have_flashinfer = importlib.util.find_spec("flashinfer") is not None
        self.config, server_args = translate_config(config, _cuda_capability(device), have_flashinfer)
        self.device = device
        self._dead: str | None = None
        self._closed = False
        self._rollout = None
        self._env = _prepare_env(device)
        with _group_lock:
            dist.ensure_process_group()
            _group_users += 1
        survive_sigquit()
        self._thread = RolloutThread("final-sglang")
        self._thread_ident = self._thread.run(threading.get_ident)
        self._watch = ProcessWatch(self._on_death, POLL_S)
        atexit.register(self.shutdown)
        try:
            from final.rollout.sglang_engine import InProcessSGLangRollout

            self._rollout = self._call(lambda: InProcessSGLangRollout(self.config, model_config, server_args))
            self._watch.started(self._rollout.engine.processes)
        except BaseException:
            self.shutdown()
            raise

    # ---- generation -----------------------------------------------------------------------------------
    def generate_sequences(self, prompts: Any, *, observer: Observer | None = None, **kwargs: Any) -> Any:
        """veRL's generate_sequences (DataProto in, DataProto out), run on the engine's thread."""
        check_sampling_kwargs(kwargs)
        return _rows_done(self._call(lambda: self._rollout.generate_sequences(prompts, **kwargs)), observer)

    async def agenerate_sequences(self, prompts: Any, *, observer: Observer | None = None, **kwargs: Any) -> Any:
        """Awaitable generate_sequences: the caller's event loop keeps running meanwhile."""
        check_sampling_kwargs(kwargs)
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
        self._call(lambda: self._thread.loop.run_until_complete(self._rollout.update_weights(weights, **kwargs)))

    # ---- cartridges (EmbeddedEngine's interface) --------------------------------------------------------
    def load_cartridge(self, cartridge_id: str, keys: list[torch.Tensor], values: list[torch.Tensor]) -> int:
        """Inject a cartridge (per-layer K/V [1,Hkv,T,D] or [Hkv,T,D], post-RoPE); an id already loaded is
        replaced. Returns its length."""
        return self._call(lambda: self._rollout.engine.cartridges.load_cartridge(cartridge_id, keys, values))

    def unload_cartridge(self, cartridge_id: str) -> bool:
        return self._call(lambda: self._rollout.engine.cartridges.unload_cartridge(cartridge_id))

    def cartridge_ids(self) -> list[str]:
        return self._call(lambda: self._rollout.engine.cartridges.cartridge_ids())

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
            self._thread.loop.call_soon_threadsafe(_cancel_all, self._thread.loop)  # a waiting call ends


def _rows_done(output: Any, observer: Observer | None) -> Any:
    """veRL's batch call is one engine call: every row finishes together."""
    if observer is not None:
        for _ in range(len(output)):
            observer.row_done()
    return output


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()


def build(engine_config: Any, rollout_config: Any, model_config: Any) -> SGLangRollout:
    """final.rollout registry factory (InferenceEngine runs preflight() on the caller's thread first)."""
    return SGLangRollout(rollout_config, model_config)
