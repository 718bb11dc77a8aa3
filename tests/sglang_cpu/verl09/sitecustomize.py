"""Stand-in for CUDA's page-locked host memory in SGLang 0.5.12's processes on a CPU-only machine (test support).

SGLang 0.5.12's logits processor builds its prompt-logprob index tensors with `torch.tensor(..., pin_memory=True)`
whatever the device (sglang/srt/layers/logits_processor.py `_get_pruned_states`), and a CPU-only torch refuses
pinned memory ("requires a CUDA or other accelerator backend"). So every scoring request killed the scheduler.
Pinning only speeds up a host-to-device copy; on the CPU device there is no copy. Where torch has no accelerator,
`torch.tensor` drops the flag; nothing else changes.

Python imports `sitecustomize` at start from any sys.path entry, so SGLang's spawned scheduler and detokenizer get
this through PYTHONPATH. It acts only where FINAL_SGLANG_CPU_UNPIN=1, which tests/sglang_helpers.use_sglang_cpu sets
in the test process at run time: so only processes started after it (SGLang's) are patched. torch is patched when
something imports it, so a process that never does pays nothing.

The wrapper must not change what `torch.tensor` is to torch itself: a device context (`with torch.device("meta")`)
recognises factory functions by identity, from a set `torch.utils._device._device_constructors()` builds once, on
first use. Built after the swap, it held the wrapper, so the real `torch.tensor` ignored device contexts;
transformers 5 then took its meta-device model init for a CPU one (`torch.tensor([]).device`), and an HF model
loaded in a patched process kept an uninitialised RoPE `inv_freq` (a different one per process): HF's SmolLM2
logprobs and HF-built cartridges were wrong there by nats (issue 43, finding 0). So the set is built first, with
the real function in it.
"""

import importlib.abc
import importlib.machinery
import os
import sys


def _patch(torch) -> None:
    if torch.cuda.is_available() or getattr(torch.tensor, "_final_unpinned", False):
        return
    import torch.utils._device

    torch.utils._device._device_constructors()  # built now, holding the real torch.tensor (see above)
    original = torch.tensor

    def tensor(*args, pin_memory=False, **kwargs):
        return original(*args, **kwargs)

    tensor._final_unpinned = True
    torch.tensor = tensor


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Wraps torch's loader: once `torch` has executed, patch it (then step aside)."""

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("FINAL_SGLANG_CPU_UNPIN") != "1":
    pass
elif "torch" in sys.modules:
    _patch(sys.modules["torch"])
else:
    sys.meta_path.insert(0, _AfterTorch())
