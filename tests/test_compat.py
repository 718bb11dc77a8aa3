"""final.compat on whichever veRL lane this venv is (both lanes run this file: tests/verl09.txt, .ci/run)."""

from __future__ import annotations

from importlib.metadata import version

import pytest
from transformers import AutoTokenizer

from final import compat
from final.config import load_config
from final.errors import ConfigError


def cfg(**rollout):
    return {"model_path": "builtin:tiny-random-llama", "rollout": rollout}


def test_the_lane_is_the_installed_verl():
    lane = {"0.6.0": "verl06", "0.9.1": "verl09"}[version("verl")]
    assert compat.LANE == lane
    assert int(version("transformers").split(".")[0]) == {"verl06": 4, "verl09": 5}[lane]
    compat.check_lane()  # the installed pair is a tested one


def test_chat_ids_is_the_rendered_template_tokenized(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    chat = [{"role": "user", "content": "hello there"}]
    ids = compat.chat_ids(tok, chat, add_generation_prompt=True)
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert all(type(i) is int for i in ids)


def test_sglang_backend_is_the_lanes():
    """verl06: veRL 0.6.0's in-process SGLangRollout (SGLang 0.5.2); verl09: SGLang 0.5.12's Engine, directly."""
    from final.rollout import backend_class

    assert load_config(cfg(name="sglang")).backend == "sglang"
    cls = backend_class("sglang")
    assert (cls.__module__, cls.name) == (("final.rollout.sglang.rollout_052" if compat.LANE == "verl06"
                                            else "final.rollout.sglang.rollout_0512"), "sglang")
    # `auto` never resolves to a backend the lane lacks (no CUDA here: local on both)
    assert load_config(cfg(name="auto")).backend == "local"


def test_rollout_mode_is_the_lanes():
    for mode in compat.ROLLOUT_MODES:
        assert load_config(cfg(mode=mode)).rollout["mode"] == mode
    unserved = {"sync", "async"} - set(compat.ROLLOUT_MODES)
    for mode in unserved | {"batch"}:
        with pytest.raises(ConfigError) as err:
            load_config(cfg(mode=mode))
        assert err.value.key == "rollout.mode" and compat.LANE in str(err.value)


def test_unserved_multi_turn_fields_are_read_from_verls_config():
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config.rollout import MultiTurnConfig

    name = compat.MULTI_TURN_UNSERVED[0]
    assert compat.unserved_multi_turn(omega_conf_to_dataclass({}, dataclass_type=MultiTurnConfig)) is None
    mt = omega_conf_to_dataclass({name: "x.yaml"}, dataclass_type=MultiTurnConfig)
    assert compat.unserved_multi_turn(mt) == name


def test_a_verl06_environment_with_transformers_5_is_refused(monkeypatch):
    from packaging.version import Version

    monkeypatch.setattr(compat, "LANE", "verl06")
    monkeypatch.setattr(compat, "TRANSFORMERS", Version("5.10.4"))
    with pytest.raises(ImportError, match=r"final\[verl06\].*final\[verl09\]"):
        compat.check_lane()
