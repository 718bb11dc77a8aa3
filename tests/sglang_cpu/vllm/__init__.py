"""Test stand-in for the few `vllm` names SGLang 0.5.2 imports on a CPU without its AMX kernel build; see
../README.md. Only these modules exist, so SGLang's optional vLLM quantization imports still find no vLLM."""
