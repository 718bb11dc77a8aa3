"""sglang/srt/layers/layernorm.py, on a CPU without SGLang's AMX build, replaces its own RMSNorm/GemmaRMSNorm with
vLLM's. Hand it back its own classes (already defined when that import runs), whose forward_native runs."""

from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm  # noqa: F401
