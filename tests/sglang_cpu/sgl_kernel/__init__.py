"""Test stand-in for the `sgl_kernel` package (sgl-kernel 0.3.9.post2, CUDA-only on PyPI); see ../README.md.

Kernel names import and raise when called (_stub.py). `scalar_type` is the real pure-Python module. Deliberately
absent: the `torch.ops.sgl_kernel.*` registrations, so SGLang's `cpu_has_amx_support()` is False and every
CustomOp takes its `forward_native` (plain PyTorch) path.
"""

from sgl_kernel import allreduce  # noqa: F401 - sglang/srt/_custom_ops.py reads sgl_kernel.allreduce at import
from sgl_kernel._stub import module_getattr

__version__ = "0.3.9.post2"  # what the kernel names stand for (SGLang checks the version only on CUDA)
__getattr__ = module_getattr(__name__)
