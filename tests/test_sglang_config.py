"""SGLang backend without an engine: requirements, attention backend choice, config translation (memory saver, the
GPU from LOCAL_RANK, one GPU per engine), sampling checks, the [sglang] extra's pins. SGLang 0.5.2 is the real
package (its ServerArgs and SamplingParams are what the checks read)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from sglang_helpers import configs, use_sglang_cpu

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def sglang_cpu():
    use_sglang_cpu()


def test_missing_requirements_name_each_piece():
    from final.rollout.sglang.config import missing_requirements

    assert missing_requirements(cuda=True, sglang=True) == []
    assert missing_requirements(cuda=False, sglang=True, device="cpu") == []
    both = missing_requirements(cuda=False, sglang=False)
    assert [m.split(" (")[0] for m in both] == ["a CUDA GPU", "the sglang package"]
    assert missing_requirements(cuda=True, sglang=False)[0].startswith("the sglang package")


def test_this_machine_gets_a_clear_error_with_the_install_command():
    from final.errors import BackendUnavailableError
    from final.rollout.sglang.config import require_sglang

    with pytest.raises(BackendUnavailableError, match=r"CUDA GPU.*pip install -e '\.\[sglang\]'"):
        require_sglang()
    require_sglang(device="cpu")  # SGLang's CPU device: the tests' explicit opt-in


def test_preflight_checks_before_any_model_is_fetched():
    import signal

    from final.config import load_config
    from final.errors import BackendUnavailableError
    from final.rollout.sglang.config import preflight

    with pytest.raises(BackendUnavailableError, match="CUDA GPU"):
        preflight(load_config(REPO / "configs" / "sglang_qwen3.yaml"))  # Qwen3 cannot be fetched here either
    preflight(load_config({"model_path": "x", "rollout": {"name": "sglang",
                                                          "engine_kwargs": {"sglang": {"device": "cpu"}}}}))
    assert signal.getsignal(signal.SIGQUIT) not in (signal.SIG_DFL, None)  # a dying scheduler won't kill us


def test_a_users_program_gets_neither_the_kernel_stubs_nor_sglang_from_auto(tmp_path):
    """SGLang 0.5.2 is installed here (for these tests), but a program of the user's, outside pytest, sees no kernel
    stub (they live in tests/sglang_cpu, put on the path by the test helpers only), and `auto` picks the embedded
    engine without CUDA; `sglang` without CUDA is refused with the install command."""
    code = ("import importlib.util\n"
            "from final.config import load_config\n"
            "from final.rollout.sglang.config import require_sglang\n"
            "print(importlib.util.find_spec('sgl_kernel'), load_config({'model_path': 'x'}).backend)\n"
            "try:\n    require_sglang()\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env=env).stdout.splitlines()
    assert out[0] == "None local" and out[1].startswith("BackendUnavailableError") and "a CUDA GPU" in out[1]


def test_without_the_package_the_error_names_it():
    from final.errors import BackendUnavailableError
    from final.rollout.sglang.config import require_sglang

    with mock.patch.dict(sys.modules, {"sglang": None}):  # find_spec("sglang") is None: as if not installed
        with pytest.raises(BackendUnavailableError, match=r"the sglang package.*\[sglang\]"):
            require_sglang(device="cpu")


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0)])
def test_fa3_is_the_default_on_ampere_and_hopper(capability):
    from final.rollout.sglang.config import choose_attention_backend

    assert choose_attention_backend(None, capability, have_flashinfer=True) == ("fa3", None)


@pytest.mark.parametrize("capability", [(7, 5), (10, 0), (12, 0)])
def test_other_gpus_fall_back_with_a_warning(capability):
    from final.rollout.sglang.config import choose_attention_backend

    backend, warning = choose_attention_backend(None, capability, have_flashinfer=True)
    assert backend == "flashinfer" and f"sm{capability[0]}{capability[1]}" in warning and "sm80-sm90" in warning
    assert choose_attention_backend(None, capability, have_flashinfer=False)[0] == "triton"


def test_an_explicit_backend_is_kept_and_fa3_on_a_wrong_gpu_is_refused():
    from final.errors import ConfigError
    from final.rollout.sglang.config import choose_attention_backend

    assert choose_attention_backend("triton", (7, 5), True) == ("triton", None)
    assert choose_attention_backend("fa3", (9, 0), True) == ("fa3", None)
    with pytest.raises(ConfigError, match="sm75") as err:
        choose_attention_backend("fa3", (7, 5), True)
    assert err.value.key == "rollout.engine_kwargs.sglang.attention_backend"
    assert choose_attention_backend(None, None, True) == ("intel_amx", None)  # SGLang's CPU device


def test_translate_config_sets_what_verl_needs(caplog):
    from final.rollout.sglang.config import translate_config

    sg_cfg, _, _ = configs(sglang_args={"random_seed": 3, "attention_backend": None})
    with caplog.at_level(logging.WARNING, logger="final.rollout.sglang"):
        cfg, server_args = translate_config(sg_cfg, (7, 5), have_flashinfer=False)
    assert cfg.engine_kwargs["sglang"] == {"attention_backend": "triton"} and "sm75" in caplog.text
    assert server_args["random_seed"] == 3 and server_args["device"] == "cpu"
    assert server_args["port"] != server_args["nccl_port"] and server_args["port"] != 30000
    assert sg_cfg.engine_kwargs["sglang"]["random_seed"] == 3  # the caller's config is not modified


@pytest.mark.parametrize("rollout,args,key,match", [
    ({"tensor_model_parallel_size": 2}, {}, "rollout.tensor_model_parallel_size", "must be 1"),
    ({"skip_tokenizer_init": False, "mode": "sync"}, {}, "rollout.skip_tokenizer_init", "token ids"),
    ({}, {"mem_fraction_static": 0.3}, "rollout.engine_kwargs.sglang.mem_fraction_static",
     "rollout.gpu_memory_utilization"),
    ({}, {"context_lenght": 10}, "rollout.engine_kwargs.sglang.context_lenght", "did you mean 'context_length'"),
    ({}, {"zzz": 1}, "rollout.engine_kwargs.sglang.zzz", "not an SGLang 0.5.2 ServerArgs field$"),
])
def test_translate_config_refuses_what_cannot_work(rollout, args, key, match):
    from final.errors import ConfigError
    from final.rollout.sglang.config import translate_config

    if "tensor_model_parallel_size" in rollout:  # our config refuses it first; veRL's own config does not
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import RolloutConfig

        sg_cfg = omega_conf_to_dataclass({"name": "sglang", **rollout}, dataclass_type=RolloutConfig)
    else:
        sg_cfg = configs(rollout, sglang_args=args)[0]
    with pytest.raises(ConfigError, match=match) as err:
        translate_config(sg_cfg, None, True)
    assert err.value.key == key


def test_the_memory_saver_is_off_unless_asked_for_and_then_checked():
    """veRL 0.6.0 hard-codes enable_memory_saver: True, and SGLang then imports torch_memory_saver (not in
    sglang[srt]) at start. final's default is False; true is refused where it cannot work, by name."""
    from final.errors import BackendUnavailableError, ConfigError
    from final.rollout.sglang.config import translate_config

    assert translate_config(configs()[0], None, True)[1]["enable_memory_saver"] is False
    with pytest.raises(ConfigError, match="CPU device") as err:
        translate_config(configs(sglang_args={"enable_memory_saver": True})[0], None, True)
    assert err.value.key == "rollout.engine_kwargs.sglang.enable_memory_saver"
    gpu = configs(sglang_args={"enable_memory_saver": True, "device": "cuda"})[0]
    with pytest.raises(BackendUnavailableError, match=r"pip install torch_memory_saver==0\.0\.8"):
        translate_config(gpu, (9, 0), True)  # not installed here


@pytest.mark.parametrize("env,gpus,expected", [({"LOCAL_RANK": "3"}, 8, 3), ({"LOCAL_RANK": "0"}, 8, 0), ({}, 8, 0),
                                               ({"LOCAL_RANK": "3"}, 1, 0)])
def test_the_gpu_comes_from_local_rank(env, gpus, expected):
    """veRL passes base_gpu_id 0: under torchrun (every GPU visible to every rank) each engine landed on GPU 0.
    Where the launcher shows each process one GPU (Ray, CUDA_VISIBLE_DEVICES), it is that one."""
    from final.rollout.sglang.config import local_gpu, translate_config

    assert local_gpu("cuda", gpus, env) == expected
    assert local_gpu("cpu", gpus, env) == 0
    cfg = configs(sglang_args={"device": "cuda"})[0]
    with mock.patch.dict(os.environ, {"LOCAL_RANK": env.get("LOCAL_RANK", "0")}):
        assert translate_config(cfg, (9, 0), True, gpus)[1]["base_gpu_id"] == expected
    assert translate_config(configs(sglang_args={"device": "cuda", "base_gpu_id": 5})[0], (9, 0), True, 8)[1][
        "base_gpu_id"] == 5  # an explicit choice wins


def test_a_local_rank_past_the_visible_gpus_is_refused():
    from final.errors import ConfigError
    from final.rollout.sglang.config import local_gpu

    with pytest.raises(ConfigError, match="LOCAL_RANK=4 but this process sees 2 GPUs"):
        local_gpu("cuda", 2, {"LOCAL_RANK": "4"})


@pytest.mark.parametrize("key,value", [("dp_size", 2), ("pp_size", 2), ("enable_dp_attention", True), ("nnodes", 2)])
def test_more_than_one_gpu_per_engine_is_refused(key, value):
    """dp_size > 1 starts SGLang's data-parallel controller, which imports its own run_scheduler_process: the
    cartridge methods never reach its schedulers. Refused before the engine starts, naming the key."""
    from final.errors import ConfigError
    from final.rollout.sglang.config import translate_config

    with pytest.raises(ConfigError, match="not supported by final's in-process engine") as err:
        translate_config(configs(sglang_args={key: value})[0], None, True)
    assert err.value.key == f"rollout.engine_kwargs.sglang.{key}"


def test_the_sglang_extra_pins_what_the_engine_needs_at_start():
    """pip install -e '.[sglang]' on a CUDA machine: veRL 0.6.0's own pins (sglang[srt,openai]==0.5.2, torch 2.8)
    plus uvloop<0.22: uvloop 0.22 dropped the main thread's implicit loop, and SGLang 0.5.2's sync Engine calls
    get_event_loop(). The CPU test engine runs with the uvloop that pin allows."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement

    extra = {Requirement(r).name: Requirement(r) for r in
             tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sglang"]}
    assert str(extra["sglang"].specifier) == "==0.5.2" and {"srt", "openai"} <= extra["sglang"].extras
    assert str(extra["torch"].specifier) == "==2.8.0"
    assert not extra["uvloop"].specifier.contains("0.22.0") and extra["uvloop"].specifier.contains("0.21.0")
    assert extra["uvloop"].specifier.contains(importlib.metadata.version("uvloop"))


def test_dummy_weights_are_warned_about(caplog):
    from final.rollout.sglang.config import translate_config

    sg_cfg = configs({"load_format": "dummy"})[0]
    with caplog.at_level(logging.WARNING, logger="final.rollout.sglang"):
        translate_config(sg_cfg, None, True)
    assert "random weights" in caplog.text


def test_sampling_overrides_are_checked_against_sglang():
    from final.errors import SamplingError, UnsupportedError
    from final.rollout.sglang.config import UNSERVED_BY_052, check_sampling_kwargs, unserved_keys

    check_sampling_kwargs({"temperature": 0.5, "top_k": 5, "stop_token_ids": [2], "max_new_tokens": 3, "stop": "x"})
    with pytest.raises(SamplingError, match="random_seed") as err:
        check_sampling_kwargs({"seed": 1})
    assert err.value.field == "seed"
    with pytest.raises(SamplingError) as err:
        check_sampling_kwargs({"logprobs": True})
    assert err.value.field == "logprobs"
    # what SGLang 0.5.2 takes and would not serve as the embedded engine does (veRL's no-op values pass)
    unserved = unserved_keys(None, UNSERVED_BY_052)
    check_sampling_kwargs({"repetition_penalty": 1.0, "presence_penalty": 0.0, "min_new_tokens": 0}, unserved)
    for key, value in (("repetition_penalty", 1.1), ("min_new_tokens", 2), ("frequency_penalty", 0.3)):
        with pytest.raises(UnsupportedError) as err:
            check_sampling_kwargs({key: value}, unserved)
        assert err.value.field == key
