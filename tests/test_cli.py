"""The `final` CLI as a user runs it (a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

from final.compat import LANE


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "final.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_prints_paris():
    res = run("generate", "What is the capital of France?", "--temperature", "0")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


def test_generate_json_and_errors(tmp_path):
    res = run("generate", "--model", "builtin:tiny-random-llama", "--max-tokens", "3", "--json", "hi", "yo")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert len(data["completions"]) == 2 and data["metadata"][0]["completion_tokens"] <= 3
    res = run("generate", "--config", str(tmp_path / "missing.yaml"), "hi")
    assert res.returncode == 2 and "config file not found" in res.stderr
    res = run("generate", "--model", "builtin:tiny-random-llama", "--temperature", "-1", "hi")
    assert res.returncode == 2 and "temperature" in res.stderr


def test_sglang_config_on_a_cpu_machine_fails_clearly():
    res = run("generate", "--config", "configs/sglang_qwen3.yaml", "hi")
    assert res.returncode == 2
    # each lane names its own SGLang install (verl06: veRL 0.6.0's pins; verl09: veRL 0.9.1's sglang)
    install = "pip install -e '.[sglang]'" if LANE == "verl06" else "pip install 'sglang==0.5.12'"
    assert "CUDA GPU" in res.stderr and install in res.stderr
