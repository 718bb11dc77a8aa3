"""sglang/srt/layers/activation.py, on a CPU without SGLang's AMX build, replaces its own SiluAndMul/GeluAndMul
with vLLM's. Hand it back its own classes (already defined when that import runs): their forward_native is plain
PyTorch, which is what the CPU engine executes anyway."""

from sglang.srt.layers.activation import GeluAndMul, SiluAndMul  # noqa: F401
