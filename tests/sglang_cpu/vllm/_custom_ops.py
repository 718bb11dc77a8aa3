"""Stand-in for vllm._custom_ops (compiled ops): names import, calls raise. sglang/srt/layers/rotary_embedding.py
imports `rotary_embedding` when it cannot use sgl-kernel's RoPE and calls it only from forward_cuda (the CPU engine
runs forward_native); model files of other architectures import a few more (awq_dequantize, ...)."""

from sgl_kernel._stub import module_getattr  # the sibling stub package (both live in tests/sglang_cpu)

__getattr__ = module_getattr(__name__)
