"""Stand-in for sgl_kernel.kvcacheio: names import, calls raise (see _stub.py)."""

from sgl_kernel._stub import module_getattr

__getattr__ = module_getattr(__name__)
