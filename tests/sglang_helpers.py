"""Shared setup for the SGLang tests: the fake SGLang on sys.path, configs, DataProtos, comparisons."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

FAKE = str(Path(__file__).parent / "fake_sglang")
TINY = "builtin:tiny-random-llama"


def use_fake_sglang() -> None:
    """Put tests/fake_sglang on sys.path, unless a real SGLang is installed (never shadow it)."""
    if FAKE in sys.path:
        return
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("a real sglang is installed; these tests drive tests/fake_sglang")
    sys.path.insert(0, FAKE)


def configs(rollout: dict[str, Any] | None = None, model: str = TINY, local_seed: int | None = None,
            sglang_args: dict[str, Any] | None = None):
    """(sglang RolloutConfig, local RolloutConfig, HFModelConfig) for one model and rollout section."""
    from final.config import load_config
    from final.models import resolve_model_path

    path = resolve_model_path(model)
    base = {"dtype": "float32", "prompt_length": 32, "response_length": 12, "calculate_log_probs": True,
            **(rollout or {})}
    sglang_kwargs = {"device": "cpu", "log_level": "warning", **(sglang_args or {})}
    sg = load_config({"model_path": path,
                      "rollout": {**base, "name": "sglang", "engine_kwargs": {"sglang": sglang_kwargs}}})
    local = {"random_seed": local_seed} if local_seed is not None else {}
    lo = load_config({"model_path": path, "rollout": {**base, "name": "local", "engine_kwargs": {"local": local}}})
    return sg.rollout_config(), lo.rollout_config(), sg.model_config(path)


def dataproto(model_config, prompt_ids: list[list[int]], meta: dict | None = None,
              non_tensor: dict[str, list] | None = None):
    from final.prompts import Prompt, build_dataproto

    tok = model_config.tokenizer
    prompts = [Prompt(ids=list(ids)) for ids in prompt_ids]
    return build_dataproto(prompt_ids, prompts, tok.pad_token_id, [tok.eos_token_id], meta_info=meta,
                           non_tensor=non_tensor)


def assert_same_output(a, b, atol: float = 1e-4) -> None:
    """Key for key, tensor for tensor: exact for ids/masks/positions; float log-probs to `atol` (the two engines
    batch the same rows differently, which moves fp32 results in the last bits)."""
    assert sorted(a.batch.keys()) == sorted(b.batch.keys())
    for key in a.batch.keys():
        x, y = a.batch[key], b.batch[key]
        assert x.shape == y.shape and x.dtype == y.dtype, key
        if x.is_floating_point():
            torch.testing.assert_close(x, y, rtol=0, atol=atol, msg=key)
        else:
            assert torch.equal(x, y), f"{key}:\n{x}\n{y}"
    assert sorted(a.non_tensor_batch) == sorted(b.non_tensor_batch)
    for key in a.non_tensor_batch:
        assert list(map(repr, a.non_tensor_batch[key])) == list(map(repr, b.non_tensor_batch[key])), key
