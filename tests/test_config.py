"""Config validation: every failure is a ConfigError naming the key path, before anything heavy starts."""

from __future__ import annotations

import pytest

from final.config import load_config
from final.errors import ConfigError


def cfg(**rollout):
    return {"model_path": "builtin:tiny-random-llama", "rollout": rollout}


def test_shipped_config_is_valid_and_builds_verl_objects(tiny_dir):
    c = load_config("config.yaml")
    assert c.model_path == "builtin:smollm2-135m-instruct" and c.backend == "local"
    rc = load_config(cfg(prompt_length=32, response_length=8)).rollout_config()
    assert type(rc).__name__ == "RolloutConfig"
    assert (rc.tensor_model_parallel_size, rc.load_format, rc.skip_tokenizer_init) == (1, "auto", True)
    assert rc.name == "local" and rc.mode == "async"
    mc = load_config(cfg()).model_config(tiny_dir)
    assert type(mc).__name__ == "HFModelConfig" and mc.local_path == tiny_dir


def test_missing_file_and_yaml_syntax(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_path: x\nrollout:\n  name: local: sglang\n")
    with pytest.raises(ConfigError, match="line 3") as err:
        load_config(bad)
    assert str(bad) in str(err.value)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        load_config(empty)


@pytest.mark.parametrize("raw, key, text", [
    ({"rollout": {}}, "model_path", "required"),
    ({"model_path": "x", "rolout": {}}, "rolout", "did you mean 'rollout'"),
    (cfg(respone_length=4), "rollout.respone_length", "did you mean 'response_length'"),
    (cfg(multi_turn={"enabel": True}), "rollout.multi_turn.enabel", "did you mean 'enable'"),
    (cfg(prompt_length="long"), "rollout.prompt_length", "must be int"),
    (cfg(temperature="hot"), "rollout.temperature", "must be float"),
    (cfg(do_sample="yes"), "rollout.do_sample", "must be bool"),
    (cfg(name="vllm"), "rollout.name", "must be one of"),
    (cfg(mode="async", skip_tokenizer_init=False), "rollout.skip_tokenizer_init", "async mode requires"),
    (cfg(tensor_model_parallel_size=2), "rollout.tensor_model_parallel_size", "must be 1"),
    (cfg(response_length=0), "rollout.response_length", ">= 1"),
    (cfg(gpu_memory_utilization=1.5), "rollout.gpu_memory_utilization", "(0, 1]"),
    (cfg(engine_kwargs={"local": {"devise": "cpu"}}), "rollout.engine_kwargs.local.devise", "did you mean 'device'"),
    ({"model_path": "x", "cartridges": [{"source": "local"}]}, "cartridges[0].id", "required"),
    ({"model_path": "x", "cartridges": [{"id": "a", "source": "ftp"}]}, "cartridges[0].source", "must be one of"),
    ({"model_path": "x", "cartridges": [{"id": "a", "pth": "/x"}]}, "cartridges[0].pth", "did you mean 'path'"),
])
def test_bad_configs_name_the_key(raw, key, text):
    with pytest.raises(ConfigError) as err:
        load_config(raw)
    assert err.value.key == key
    assert text in str(err.value)


def test_lengths_checked_against_the_model(tiny_dir):
    c = load_config(cfg(prompt_length=4000, response_length=200))
    with pytest.raises(ConfigError) as err:
        c.check_against_model(tiny_dir)
    assert err.value.key == "rollout.response_length" and "4096" in str(err.value)
    assert load_config(cfg(prompt_length=100, response_length=20)).check_against_model(tiny_dir) == 120


def test_overrides_merge_deeply():
    c = load_config("config.yaml", {"rollout": {"response_length": 7}, "model_path": "builtin:tiny-random-llama"})
    assert c.rollout["response_length"] == 7 and c.rollout["prompt_length"] == 1024
    assert c.model_path == "builtin:tiny-random-llama"


def test_replicas_and_ray_address_keys(tmp_path):
    base = {"model_path": "builtin:tiny-random-llama"}
    cfg = load_config({**base, "replicas": 4, "ray_address": "10.0.0.1:6379"})
    assert (cfg.replicas, cfg.ray_address) == (4, "10.0.0.1:6379")
    assert (load_config(base).replicas, load_config(base).ray_address) == (1, None)
    for key, value in (("replicas", 0), ("replicas", "2"), ("replicas", True), ("replicas", 1.5),
                       ("ray_address", ""), ("ray_address", 6379)):
        with pytest.raises(ConfigError) as err:
            load_config({**base, key: value})
        assert err.value.key == key
    path = tmp_path / "c.yaml"
    path.write_text("model_path: builtin:tiny-random-llama\nreplica: 2\n")
    with pytest.raises(ConfigError, match="did you mean 'replicas'"):
        load_config(str(path))
