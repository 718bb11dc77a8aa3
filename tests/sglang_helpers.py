"""Shared setup for the SGLang tests: the real SGLang 0.5.2 on CPU (kernel stubs from tests/sglang_cpu on the path),
configs, DataProtos, comparisons."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

STUBS = str(Path(__file__).parent / "sglang_cpu")
# verl09 lane (SGLang 0.5.12): a torchvision stand-in too (PyPI's torchvision for torch 2.13 is a CUDA build).
STUBS_09 = str(Path(__file__).parent / "sglang_cpu" / "verl09")
TINY = "builtin:tiny-random-llama"
# What every CPU test engine gets: SGLang's CPU device (the explicit opt-in: `auto` never picks SGLang without CUDA)
# and a KV pool of a few thousand tokens (unset, SGLang sizes it from free RAM: ~6 GB and a 20 s start).
CPU_ARGS = {"device": "cpu", "log_level": "warning", "max_total_tokens": 2048}


def use_sglang_cpu() -> None:
    """Make the lane's real SGLang (0.5.2 on verl06, 0.5.12 on verl09) importable here: tests/sglang_cpu (stand-ins
    for the compiled sgl_kernel and vllm packages, and torchvision on verl09) on sys.path and on PYTHONPATH, which
    SGLang's spawned scheduler and detokenizer inherit. Stubs are added only where no real package is installed (a
    CUDA machine with the [sglang] extra keeps its own)."""
    from final.compat import LANE, SGLANG_PIN

    if importlib.util.find_spec("sglang") is None:
        pytest.fail(f"{SGLANG_PIN} is not installed: run `bash scripts/install.sh` (it installs the CPU test engine; "
                    f"FINAL_LANE=verl09 for the verl09 lane)")
    if torch.cuda.is_available():  # SGLang picks its CUDA kernels whenever CUDA is there, whatever the device
        pytest.skip("the SGLang tests run SGLang's CPU device on machines without a GPU; on CUDA run "
                    "scripts/gpu_smoke.py", allow_module_level=True)
    wanted = [(STUBS, ("sgl_kernel", "vllm"))] + ([(STUBS_09, ("torchvision",))] if LANE == "verl09" else [])
    for folder, packages in wanted:
        if folder in sys.path or all(importlib.util.find_spec(p) for p in packages):
            continue
        sys.path.insert(0, folder)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)
    if LANE == "verl09":
        os.environ["FINAL_SGLANG_CPU_UNPIN"] = "1"  # for SGLang's processes, started later (verl09/sitecustomize.py)


def pythonpath(*extra: str) -> str:
    """PYTHONPATH for a child process that runs SGLang (a script, a notebook kernel)."""
    use_sglang_cpu()
    return os.pathsep.join(p for p in (*extra, os.environ.get("PYTHONPATH")) if p)


def configs(rollout: dict[str, Any] | None = None, model: str = TINY, local_seed: int | None = None,
            sglang_args: dict[str, Any] | None = None):
    """(sglang RolloutConfig, local RolloutConfig, HFModelConfig) for one model and rollout section."""
    from final.config import load_config
    from final.models import resolve_model_path

    path = resolve_model_path(model)
    base = {"dtype": "float32", "prompt_length": 32, "response_length": 12, "calculate_log_probs": True,
            **(rollout or {})}
    sglang_kwargs = {**CPU_ARGS, **(sglang_args or {})}
    sg = load_config({"model_path": path,
                      "rollout": {**base, "name": "sglang", "engine_kwargs": {"sglang": sglang_kwargs}}})
    local = {"random_seed": local_seed} if local_seed is not None else {}
    lo = load_config({"model_path": path, "rollout": {**base, "name": "local", "engine_kwargs": {"local": local}}})
    return sg.rollout_config(), lo.rollout_config(), sg.model_config(path)


# token-id prompts of different lengths, the last one's id far into the vocabulary
PROMPTS = [[1, 504, 3456, 28, 253], [1, 17, 99], [1, 2035, 441, 873, 12, 9, 1111, 20, 330, 45, 7, 8], [1, 40000]]


class OnThread:
    """LocalRollout the way InferenceEngine drives every rollout: on a RolloutThread (veRL's run_until_complete)."""

    def __init__(self, rollout):
        from final.rollout.thread import RolloutThread

        self.rollout, self.thread = rollout, RolloutThread("test-local")

    def generate_sequences(self, prompts, **kwargs):
        return self.thread.run(self.rollout.generate_sequences, prompts, **kwargs)

    def shutdown(self):
        self.rollout.shutdown()
        self.thread.close()


def rollout_pair():
    """A module fixture's body (`yield from`): (the lane's SGLang rollout, LocalRollout on its thread, model config)
    on the tiny model with greedy val_kwargs, the two sides of a differential test; both shut down after."""
    use_sglang_cpu()
    from final.rollout import backend_class
    from final.rollout.local import LocalRollout

    sglang_class = backend_class("sglang")  # the lane's: final.compat.SGLANG_ROLLOUT

    sg_cfg, local_cfg, model_cfg = configs({"val_kwargs": {"temperature": 0}})
    sglang = sglang_class(sg_cfg, model_cfg)
    local = OnThread(LocalRollout(local_cfg, model_cfg))
    yield sglang, local, model_cfg
    sglang.shutdown()
    local.shutdown()


def both(pair, prompts, meta=None, **kwargs):
    """The same DataProto through both sides of a rollout_pair."""
    sglang, local, model_cfg = pair
    a = sglang.generate_sequences(dataproto(model_cfg, prompts, meta), **kwargs)
    b = local.generate_sequences(dataproto(model_cfg, prompts, meta), **kwargs)
    return a, b


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
