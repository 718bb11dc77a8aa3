"""final: an in-process inference wrapper on veRL's rollout contract."""

__version__ = "0.1.0"
