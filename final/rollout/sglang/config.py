"""RolloutConfig -> what veRL's SGLangRollout and SGLang 0.5.2's ServerArgs get; checked before anything starts.
(The verl09 lane's rollout_0512.py builds SGLang 0.5.12's ServerArgs with translate_config too.) Also what both
lanes check before a model is fetched: the requirements (a GPU unless SGLang's CPU device is asked for, the
package) and SamplingParams' keys.

veRL 0.6.0 builds the engine's arguments itself (sglang_rollout.py `_init_inference_engine`) and hard-codes a few
that are wrong for one in-process engine: `enable_memory_saver: True`, `base_gpu_id: 0`, `port: 30000 + rank`, and
it drops every engine_kwargs.sglang key but attention_backend. FinalSGLangEngine overrides them with the
ServerArgs computed here. Imports sglang only inside functions (this runs before SGLang is known to be there).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import inspect
import logging
import os
from typing import Any, Mapping

from final import compat, process_group as dist
from final.errors import BackendUnavailableError, ConfigError, SamplingError

logger = logging.getLogger(__name__)

# ServerArgs the rollout config already decides: engine_kwargs.sglang may not override them.
OWNED_SERVER_ARGS = {
    "model_path": "model_path", "tokenizer_path": "tokenizer_path", "trust_remote_code": "trust_remote_code",
    "tp_size": "rollout.tensor_model_parallel_size", "dtype": "rollout.dtype",
    "mem_fraction_static": "rollout.gpu_memory_utilization", "load_format": "rollout.load_format",
    "skip_tokenizer_init": "rollout.skip_tokenizer_init", "max_running_requests": "rollout.max_num_seqs",
    "mm_attention_backend": "rollout.engine_kwargs.sglang.attention_backend",
}
# ServerArgs that would make one engine span several GPUs or processes of schedulers. The cartridge scheduler
# patch reaches only schedulers that SGLang's engine module starts itself (the data-parallel controller imports
# its own reference to run_scheduler_process), and a pipeline stage's KV pool holds only its own layers.
ONE_GPU_ARGS = {
    "dp_size": "data parallelism: run one engine per GPU (LOCAL_RANK picks the GPU), as veRL's workers do",
    "pp_size": "pipeline stages: one engine runs on one GPU",
    "enable_dp_attention": "data-parallel attention needs dp_size > 1",
    "nnodes": "an in-process engine runs on one node",
}
MEMORY_SAVER = "torch_memory_saver==0.0.8"  # the version sglang[torch_memory_saver] 0.5.2 pins


# What each lane installs for rollout.name: sglang (veRL 0.6.0's [sglang] extra; veRL 0.9.1's pin)
INSTALL = {"verl06": ("sglang[srt]==0.5.2", "On a CUDA 12 machine: pip install -e '.[sglang]' (SGLang 0.5.2 and torch "
                                            "2.8, as veRL 0.6.0 pins them)"),
           "verl09": ("sglang==0.5.12", "On a CUDA machine of the verl09 lane: pip install 'sglang==0.5.12' (veRL "
                                        "0.9.1's pin)")}


def missing_requirements(cuda: bool, sglang: bool, device: str = "cuda", pin: str | None = None) -> list[str]:
    """What keeps SGLang from running: a CUDA GPU (unless SGLang's CPU device is chosen) and the package."""
    missing = []
    if device != "cpu" and not cuda:
        missing.append("a CUDA GPU (torch.cuda.is_available() is False)")
    if not sglang:
        missing.append(f"the sglang package ({pin or INSTALL[compat.LANE][0]})")
    return missing


def require_sglang(device: str = "cuda") -> None:
    """Raise BackendUnavailableError naming what is missing and how to install it (this lane's SGLang)."""
    import torch

    missing = missing_requirements(torch.cuda.is_available(), importlib.util.find_spec("sglang") is not None, device)
    if missing:
        raise BackendUnavailableError(f"rollout.name: sglang needs {' and '.join(missing)}. {INSTALL[compat.LANE][1]}. "
                                      f"Without a GPU use rollout.name: local or auto.")


def preflight(engine_config: Any) -> None:
    """What InferenceEngine runs first when rollout.name resolves to sglang, on the caller's thread: the
    requirements check (before any model download) and SIGQUIT survival (only the main thread can set it)."""
    from final.rollout.sglang.procs import survive_sigquit

    require_sglang(sglang_device(engine_config.rollout.get("engine_kwargs")))
    survive_sigquit()


def choose_attention_backend(requested: str | None, capability: tuple[int, int] | None,
                             have_flashinfer: bool) -> tuple[str, str | None]:
    """(backend, warning or None). SGLang 0.5.2's fa3 backend needs sm80-sm90 ("FlashAttention v3 Backend requires
    SM>=80 and SM<=90"): the default there, elsewhere flashinfer (or triton) with a warning. capability None means
    SGLang's CPU device, whose backend is intel_amx (SGLang itself falls back to torch_native without AMX)."""
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


def local_gpu(device: str, gpu_count: int, env: Mapping[str, str] = os.environ) -> int:
    """The GPU index this process's engine uses: LOCAL_RANK under a multi-process launcher that shows every GPU
    to every process (torchrun), 0 where the launcher shows each process its own GPU (Ray, CUDA_VISIBLE_DEVICES).
    veRL 0.6.0 passes base_gpu_id 0, which puts every engine of a torchrun job on GPU 0."""
    if device == "cpu":
        return 0
    raw = env.get("LOCAL_RANK", "0")
    try:
        rank = int(raw)
    except ValueError:
        raise ConfigError(f"LOCAL_RANK must be an integer, got {raw!r}", key="LOCAL_RANK") from None
    if gpu_count <= 1:
        return 0
    if 0 <= rank < gpu_count:
        return rank
    raise ConfigError(f"LOCAL_RANK={rank} but this process sees {gpu_count} GPUs; set CUDA_VISIBLE_DEVICES or "
                      f"rollout.engine_kwargs.sglang.base_gpu_id", key="LOCAL_RANK")


def _check_one_gpu(extra: dict) -> None:
    for key, why in ONE_GPU_ARGS.items():
        value = extra.get(key)
        if value is not None and value is not False and not (type(value) is int and value == 1):
            raise ConfigError(f"{value!r} is not supported by final's in-process engine ({why})",
                              key=f"rollout.engine_kwargs.sglang.{key}")


def _check_memory_saver(extra: dict, device: str) -> None:
    """veRL hard-codes enable_memory_saver: True for trainers that offload the engine between steps. An inference
    wrapper never does, and the saver needs torch_memory_saver (not in sglang[srt]) preloaded into SGLang's
    children, so final's default is False; true is honoured on CUDA when the package is installed."""
    if not extra.get("enable_memory_saver"):
        return
    key = "rollout.engine_kwargs.sglang.enable_memory_saver"
    if device == "cpu":
        raise ConfigError("the memory saver pauses CUDA memory; it cannot run on SGLang's CPU device", key=key)
    if importlib.util.find_spec("torch_memory_saver") is None:
        raise BackendUnavailableError(f"{key}: true needs the torch_memory_saver package: pip install {MEMORY_SAVER}"
                                      f" (or leave it false, final's default)")


def sglang_device(engine_kwargs: Any) -> str:
    """`rollout.engine_kwargs.sglang.device`: SGLang's CPU device only when asked for by name."""
    return ((engine_kwargs or {}).get("sglang") or {}).get("device") or "cuda"


def translate_config(config: Any, capability: tuple[int, int] | None, have_flashinfer: bool,
                     gpu_count: int = 1, port_below: int | None = None) -> tuple[Any, dict]:
    """RolloutConfig -> (the RolloutConfig veRL gets, ServerArgs that override veRL's for the engine). port_below
    bounds the free port chosen for SGLang's `port` (SGLang 0.5.12 derives port + 10000 from it)."""
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
            raise ConfigError(f"is not an SGLang {_installed()} ServerArgs field{hint}", key=where)
    device = extra.get("device") or "cuda"
    _check_one_gpu(extra)
    _check_memory_saver(extra, device)
    port = nccl_port = dist.free_port(below=port_below)
    while nccl_port == port:
        nccl_port = dist.free_port()
    server_args = {"port": port, "nccl_port": nccl_port,
                   "enable_memory_saver": False,
                   "base_gpu_id": local_gpu(device, gpu_count), **extra}
    engine_kwargs = {**(config.engine_kwargs or {}), "sglang": {"attention_backend": backend}}
    return dataclasses.replace(config, engine_kwargs=engine_kwargs), server_args


def _installed() -> str:
    """The SGLang release whose ServerArgs are checked (0.5.2 on the verl06 lane, 0.5.12 on verl09)."""
    from importlib.metadata import version

    return version("sglang")


@functools.cache
def sampling_keys() -> frozenset[str]:
    """SamplingParams' keyword names in the installed SGLang (read once: checks run for every row)."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    return frozenset(inspect.signature(SamplingParams.__init__).parameters) - {"self"}


def check_sampling_key(key: str) -> None:
    allowed = sampling_keys()
    if key not in allowed:
        raise SamplingError(f"is not an SGLang {_installed()} sampling parameter ({', '.join(sorted(allowed))})", key)


# Why neither SGLang lane constrains decoding (the local backend does: final/engine/grammar.py)
NO_GRAMMAR = {
    "verl06": "veRL 0.6.0 starts SGLang 0.5.2 with skip_tokenizer_init, where SGLang has no grammar backend (its "
              "scheduler asserts one): use rollout.name: local",
    "verl09": "the verl09 lane starts SGLang 0.5.12 with grammar_backend none: its xgrammar backend needs xgrammar "
              "0.2.0, which this lane does not install, and its llguidance backend reads only legacy structural "
              "tags; use rollout.name: local",
}


def refuse_constraints(params: dict) -> None:
    """UnsupportedError naming the lane for a constraint key (json_schema, regex, ebnf, structural_tag): SGLang
    would otherwise assert in its scheduler (0.5.2) or abort the row (0.5.12)."""
    from final.errors import UnsupportedError
    from final.sampling import CONSTRAINT_KEYS

    for key in CONSTRAINT_KEYS:
        if params.get(key) is not None:
            raise UnsupportedError("sglang", key, f"not supported by the sglang backend ({compat.LANE} lane): "
                                                  f"{NO_GRAMMAR[compat.LANE]}")


def check_sampling_kwargs(kwargs: dict) -> None:
    """Per-call overrides become SGLang SamplingParams(**params): refuse what 0.5.2 would reject, by name."""
    refuse_constraints(kwargs)
    for key in kwargs:
        if key == "seed":
            raise SamplingError("SGLang 0.5.2 has no per-request seed; set rollout.engine_kwargs.sglang.random_seed",
                                key)
        check_sampling_key(key)
