"""What a training command reads: the engine (the embedded one through InferenceEngine, the one composition root),
a document, and the settings file beside its flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from final.cartridges.build import read_document
from final.inf import InferenceEngine, local_engine
from final.training.settings import read_settings


def open_engine(model: str, dtype: str, device: str = "cpu", config: str | None = None) -> InferenceEngine:
    """The engine of the teacher and the samples: `config`'s (any backend), else the embedded engine on `device`."""
    if config:
        return InferenceEngine(config)
    return local_engine(model, dtype=dtype, device=device)


def read_text(path: Path) -> str:
    """A document a user hands in, as UTF-8 (a typed error naming the file otherwise)."""
    return read_document(path, "text")


def read_settings_file(path: Path | None, cls: type, **fixed: Any) -> Any:
    """`cls` (final.training.settings) from `--settings FILE` (read_settings), or its defaults without one, checked;
    `fixed`: the values of the command's flags."""
    if path is not None:
        return read_settings(path, cls, **fixed)
    out = cls(**fixed)
    out.check()
    return out
