"""Shared fixtures: real models (a 2-layer random Llama for speed, SmolLM2-135M for real answers)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = "builtin:tiny-random-llama"
SMOL = "builtin:smollm2-135m-instruct"


@pytest.fixture(scope="session")
def tiny_dir() -> str:
    from final.models import resolve_model_path

    return resolve_model_path(TINY)


@pytest.fixture(scope="session")
def smol_dir() -> str:
    from final.models import resolve_model_path

    return resolve_model_path(SMOL)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def tiny_engine(tiny_dir):
    from final.engine import EmbeddedEngine

    engine = EmbeddedEngine(tiny_dir)
    yield engine
    engine.shutdown()


def tiny_config(**rollout) -> dict:
    """A config dict for the tiny model on the embedded engine (short lengths keep tests fast)."""
    return {"model_path": TINY, "progress": False,
            "rollout": {"name": "local", "prompt_length": 64, "response_length": 16, "calculate_log_probs": True,
                        **rollout}}


@pytest.fixture(scope="session")
def tiny_inference():
    from final.inf import InferenceEngine

    with InferenceEngine(tiny_config()) as engine:
        yield engine


async def sleeps_until_cancelled(cancelled: list) -> None:
    """Work that never finishes on its own: it records its cancellation in `cancelled` (tests of who cancels what)."""
    import asyncio

    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        cancelled.append(True)
        raise
