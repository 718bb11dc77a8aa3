"""veRL 0.6.0's own PPO/GRPO trainer on a machine without a GPU, generating with final's embedded engine.

    VERL_USE_EXTERNAL_MODULES=final.verl_cpu python -m verl.trainer.main_ppo ... \\
        actor_rollout_ref.rollout.name=final actor_rollout_ref.rollout.mode=sync \\
        actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.ref.strategy=fsdp2 critic.strategy=fsdp2 \\
        +ray_kwargs.ray_init.num_gpus=1 \\
        +ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES=final.verl_cpu ...
(docs/guides/train-a-policy.md has the whole command.) veRL imports this module in every process that
imports veRL (the driver and each Ray worker) when VERL_USE_EXTERNAL_MODULES names it. It registers final's rollout
(`rollout.name: final`, final.verl_replica) and fills in what veRL 0.6.0 assumes of a CUDA machine, each a place
it breaks on CPU (read from veRL 0.6.0, then found by running its trainer):
- `get_nccl_backend()` raises without CUDA (fsdp_workers.py's process group): gloo;
- the group's backend string becomes "cpu:gloo,cpu:gloo" (device "cpu" twice), which torch refuses: deduplicated;
- `torch.cpu` lacks the memory and RNG functions veRL calls through `get_torch_device()` (empty_cache,
  memory_allocated, get/set_rng_state, manual_seed...): added (no-ops for memory, torch's global RNG);
- `topk_reduce_ratio_min_max` all-gathers a 0-dim tensor into 1-element ones, which NCCL lets pass and gloo
  refuses: at world size 1 the answer is the timing itself.
Ray must offer one (pretend) GPU: veRL's resource pool asks for "GPU" resources; nothing runs on one. FSDP1 refuses
CPU parameters with `sync_module_states=True` (veRL hard-codes it): use fsdp2. `model.use_remove_padding=false`,
`override_config._attn_implementation=sdpa` (flash-attention 2 is hard-coded otherwise). Only the first setting of
each is made; importing this module twice changes nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as tdist
import verl.utils.device as verl_device
import verl.utils.profiler.performance as verl_performance

import final.verl_replica  # noqa: F401 - registers rollout.name "final" (and "tokasaurus")

_MEMORY = ("empty_cache", "reset_peak_memory_stats", "synchronize")
_COUNTERS = ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved")


def _install() -> None:
    if getattr(verl_device, "_final_cpu", False) or torch.cuda.is_available():
        return  # a CUDA machine needs none of this
    verl_device.get_nccl_backend = lambda: "gloo"
    for name in _MEMORY:
        _add(name, lambda *a, **k: None)
    for name in _COUNTERS:
        _add(name, lambda *a, **k: 0)
    _add("mem_get_info", lambda *a, **k: (0, 0))
    _add("get_rng_state", torch.get_rng_state)
    _add("set_rng_state", torch.set_rng_state)
    _add("manual_seed", torch.manual_seed)
    _add("manual_seed_all", torch.manual_seed)
    _add("current_device", lambda: 0)
    _add("set_device", lambda *a: None)
    tdist.init_process_group = _deduplicated(tdist.init_process_group)
    verl_performance.topk_reduce_ratio_min_max = _one_rank(verl_performance.topk_reduce_ratio_min_max)
    verl_device._final_cpu = True


def _add(name: str, fn) -> None:
    if not hasattr(torch.cpu, name):
        setattr(torch.cpu, name, fn)


def _deduplicated(init):
    def init_process_group(*args, backend=None, **kwargs):
        if isinstance(backend, str) and "," in backend:
            backend = ",".join(dict.fromkeys(backend.split(",")))
        return init(*args, backend=backend, **kwargs)

    return init_process_group


def _one_rank(topk):
    def topk_reduce_ratio_min_max(timing: float, k: int = 10) -> tuple[float, float, float]:
        if tdist.is_initialized() and tdist.get_world_size() > 1:
            return topk(timing, k)
        return 0.0, float(timing), float(timing)

    return topk_reduce_ratio_min_max


_install()
