"""Shared helpers for the cartridge tests: real engines on real models, random cartridges, document fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from final.cartridges.format import CartridgeKV

DOCS = Path(__file__).parent / "cartridges_docs"
TINY = "builtin:tiny-random-llama"  # 2 layers, 2 KV heads, head_dim 16, SmolLM2 tokenizer
SMOLLM2 = "builtin:smollm2-135m-instruct"


def open_engine(model: str = TINY, **kwargs):
    from transformers import AutoTokenizer

    from final.engine.engine import EmbeddedEngine
    from final.models import resolve_model_path

    path = resolve_model_path(model)
    return EmbeddedEngine(path, dtype="float32", **kwargs), AutoTokenizer.from_pretrained(path)


def random_cart(layers: int = 2, heads: int = 2, tokens: int = 8, dim: int = 16, frozen: int = 1,
                dtype: torch.dtype = torch.float32, seed: int = 0) -> CartridgeKV:
    g = torch.Generator().manual_seed(seed)
    shape = (1, heads, tokens, dim)
    keys = [torch.randn(shape, generator=g).to(dtype) for _ in range(layers)]
    values = [torch.randn(shape, generator=g).to(dtype) for _ in range(layers)]
    return CartridgeKV(keys, values, frozen)


def documents() -> dict[str, tuple[str, list[str]]]:
    """name -> (text, questions) for the five canary documents."""
    questions = json.loads((DOCS / "questions.json").read_text())
    return {name: ((DOCS / name).read_text(), qs) for name, qs in questions.items()}


def greedy(engine, ids, n: int = 12, **kwargs) -> list[int]:
    return engine.generate(list(ids), {"max_new_tokens": n, "temperature": 0.0}, **kwargs)["output_ids"]
