"""Fake SGLang 0.5.2 for CPU tests (see tests/fake_sglang/README.md). Mirrors python/sglang/__init__.py's version."""

from sglang.version import __version__

FAKE = True  # lets tests tell this package from a real install; product code never reads it
