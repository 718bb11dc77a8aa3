"""Weight updates into SGLang (both lanes): the tensors cross to the scheduler process through SGLang's
`update_weights_from_tensor` (torch's multiprocessing reductions: CUDA IPC handles on a GPU, shared memory on CPU).

SGLang patches torch's tensor reduction to send a CUDA device's UUID instead of its index
(`monkey_patch_torch_reductions`, veRL's path calls it), and the patch assumes every tensor is a CUDA tensor: a CPU
tensor's reduction has no device argument and the patch fails (IndexError in `_modify_tuple`). A CPU tensor is
what a trainer on the CPU, or a state dict read from disk, hands in. `share_tensors_safely` applies SGLang's patch
to CUDA tensors only.
"""

from __future__ import annotations

from typing import Any

import torch


def share_tensors_safely() -> None:
    """SGLang's reduction patch for CUDA tensors, torch's own for the rest (idempotent)."""
    from torch.multiprocessing import reductions

    if getattr(reductions, "_final_cpu_safe", False):
        return
    try:
        from sglang.srt.patch_torch import monkey_patch_torch_reductions  # 0.5.2
    except ImportError:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions  # 0.5.12
    monkey_patch_torch_reductions()
    patched, original = reductions.reduce_tensor, reductions._reduce_tensor_original

    def reduce_tensor(tensor: torch.Tensor) -> Any:
        return patched(tensor) if tensor.is_cuda else original(tensor)

    reductions.reduce_tensor = reduce_tensor
    reductions._final_cpu_safe = True
    reductions.init_reductions()


def contiguous(named: list[tuple[str, torch.Tensor]], device: str) -> list[tuple[str, torch.Tensor]]:
    """What crosses to the scheduler: whole tensors on the engine's device type (a CPU update into a GPU engine
    goes over as CUDA IPC, not a copy through shared memory), contiguous."""
    target = torch.device("cuda") if device != "cpu" and torch.cuda.is_available() else torch.device("cpu")
    return [(name, t.detach().to(target).contiguous()) for name, t in named]
