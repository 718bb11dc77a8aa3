"""Stand-ins for sgl-kernel's compiled CUDA kernels: every name imports, and calling one raises.

SGLang 0.5.2 imports about a dozen kernel names at module level on the path the CPU tests take and calls none of
them (CustomOps dispatch to forward_native on a CPU without SGLang's AMX build; attention is torch_native). A call
that does reach one means the CPU engine left the path these tests verify, so it fails loudly with the name.
"""

from __future__ import annotations

from typing import Any, Callable


class KernelNotAvailable(RuntimeError):
    """An sgl-kernel CUDA kernel was called in the CPU test engine."""


def kernel(qualname: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise KernelNotAvailable(f"{qualname} is a CUDA kernel of sgl-kernel; the CPU test stub "
                                 f"(tests/sglang_cpu) only lets it import")

    call.__name__ = call.__qualname__ = qualname.rsplit(".", 1)[-1]
    return call


def module_getattr(module: str) -> Callable[[str], Any]:
    """A PEP 562 module __getattr__: any public name is a kernel that raises when called."""

    def __getattr__(name: str) -> Any:
        if name.startswith("_"):  # __path__, __spec__, ...: behave as a plain module
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return kernel(f"{module}.{name}")

    return __getattr__
