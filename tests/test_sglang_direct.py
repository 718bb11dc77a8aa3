"""The verl09 lane's SGLang backend on the real SGLang 0.5.12 engine on CPU: tests/sglang_direct_cases.py, run in
a pytest process of its own whose path has the CPU stand-ins from the start (transformers decides at import
whether torchvision exists; a suite that imported it earlier cannot take SGLang 0.5.12 afterwards)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from final import compat
from sglang_helpers import STUBS, STUBS_09

HERE = Path(__file__).parent
# the backend's differential, tools, scoring and lifecycle cases; cartridges and token streams; weight updates;
# one meaning per sampling key (one engine each)
CASES = ["sglang_direct_cases.py", "sglang_direct_cartridge_cases.py", "sglang_direct_weight_cases.py",
         "sglang_direct_sampling_cases.py"]


@pytest.mark.parametrize("cases", CASES)
@pytest.mark.skipif(compat.LANE != "verl09", reason="the verl09 lane's backend (SGLang 0.5.12); the verl06 lane's "
                    "is tests/test_sglang_rollout.py")
def test_sglang_0_5_12_cases_in_a_process_of_their_own(cases):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the SGLang tests run SGLang's CPU device on machines without a GPU; on CUDA run "
                    "scripts/gpu_smoke.py")
    path = os.pathsep.join(p for p in (STUBS, STUBS_09, os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
                           "-o", "faulthandler_timeout=600", str(HERE / cases)], cwd=HERE.parent, capture_output=True,
                          text=True, timeout=1500, env={**os.environ, "PYTHONPATH": path})
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    # every case ran (none skipped: the child has the stand-ins and SGLang 0.5.12), and passed
    assert done.returncode == 0 and " passed" in summary and not re.search(r"failed|skipped|error", summary), \
        done.stdout[-8000:] + done.stderr[-4000:]


def test_a_stream_update_carrying_several_tokens_becomes_one_per_token():
    """SGLang 0.5.12 hands a reader that fell behind only its latest cumulative state: per_token splits it back into
    one update per token, each with its own prefix of the per-token lists, the finish reason on the last only."""
    from final.rollout.sglang.engine_0512 import per_token

    pairs = [(-1.0, 5, None), (-2.0, 6, None), (-3.0, 7, None)]
    item = {"output_ids": [5, 6, 7], "meta_info": {"finish_reason": {"type": "length"}, "prompt_tokens": 4,
                                                   "completion_tokens": 3, "output_token_logprobs": pairs}}
    first, last = per_token(item, 1)
    assert first["output_ids"] == [5, 6] and first["meta_info"]["output_token_logprobs"] == pairs[:2]
    assert first["meta_info"]["finish_reason"] is None and first["meta_info"]["completion_tokens"] == 2
    assert first["meta_info"]["prompt_tokens"] == 4 and last is item
    assert per_token(item, 2) == [item] and len(per_token(item, 0)) == 3
    assert item["output_ids"] == [5, 6, 7] and len(item["meta_info"]["output_token_logprobs"]) == 3  # not altered


STAND_IN_PROBE = """
import torch
from transformers import AutoModelForCausalLM
assert getattr(torch.tensor, "_final_unpinned", False), "the stand-in did not act"
with torch.device("meta"):
    assert torch.tensor([]).device.type == "meta", "torch.tensor ignores device contexts"
model = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.float32)
rope = model.model.rotary_emb
dim, theta = rope.inv_freq.shape[0] * 2, model.config.rope_parameters["rope_theta"]
expected = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
torch.testing.assert_close(rope.inv_freq, expected, rtol=0, atol=0)
print("ok")
"""


@pytest.mark.skipif(compat.LANE != "verl09", reason="the verl09 lane's stand-in (tests/sglang_cpu/verl09)")
def test_the_pin_memory_stand_in_leaves_hf_models_and_device_contexts_alone(smol_dir):
    """Issue 43, finding 0: with the stand-in acting, torch.tensor ignored `with torch.device(...)`, so transformers 5
    initialised SmolLM2's RoPE inv_freq from uninitialised memory; an HF-built cartridge and HF's reference logprobs
    in such a process were off by up to 3.56 nats/token (SGLang 0.5.12 itself served the cartridge exactly)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (STUBS_09, os.environ.get("PYTHONPATH")) if p),
           "FINAL_SGLANG_CPU_UNPIN": "1"}
    done = subprocess.run([sys.executable, "-c", STAND_IN_PROBE.format(path=smol_dir)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
