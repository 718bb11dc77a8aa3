"""scripts/gpu_smoke.py: a clear error on this CPU machine, and a full run on the real SGLang 0.5.2 on CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from sglang_helpers import CPU_ARGS, pythonpath

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "scripts" / "gpu_smoke.py")


def run(args: list[str], path: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300, env=env)


def test_without_cuda_it_says_what_is_missing_and_how_to_install():
    done = run([], str(REPO))
    assert done.returncode == 2
    assert "a CUDA GPU" in done.stderr and "pip install -e '.[sglang]'" in done.stderr


def test_full_run_on_sglang_on_cpu(tmp_path):
    config = tmp_path / "smoke.yaml"
    config.write_text(yaml.safe_dump({
        "model_path": "builtin:tiny-random-llama",
        "rollout": {"name": "sglang", "prompt_length": 64, "response_length": 16, "dtype": "float32",
                    "engine_kwargs": {"sglang": CPU_ARGS}}}))
    done = run(["--config", str(config), "--prompts", "4", "--max-tokens", "8"], pythonpath(str(REPO)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "first answer in" in done.stdout and re.search(r"4 prompts, \d+ tokens in .* tokens/s", done.stdout)
    assert done.stdout.strip().endswith("ok: the SGLang backend works")
