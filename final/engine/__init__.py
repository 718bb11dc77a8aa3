"""The embedded engine: SGLang 0.5.2's Engine dialect in plain PyTorch (see engine.py)."""

from final.engine.engine import EmbeddedEngine
from final.engine.sampling_params import SamplingParams

__all__ = ["EmbeddedEngine", "SamplingParams"]
