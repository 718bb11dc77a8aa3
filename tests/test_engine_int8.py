"""`engine_kwargs.local.quantization: int8`: int8 weight matrices on the engine's kernel (every row count; opt-in
speed mode on CPU; its agreement with fp32 on SmolLM2 is measured in bench/RESULTS.md, not claimed here), and a
ConfigError naming why where the kernel cannot run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from final.config import load_config
from final.engine import EmbeddedEngine
from final.engine import kernels
from final.engine.linear import Int8Linear
from final.errors import ConfigError

KERNEL = kernels.gemv_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the engine's kernel does not run here (int8 is refused)")


@needs_kernel
def test_int8_linear_is_close_to_fp32_and_takes_weight_updates():
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(48, 64, generator=g), torch.randn(48, generator=g), torch.randn(3, 64, generator=g)
    lin = Int8Linear(w.clone(), b.clone(), gemv=KERNEL)
    want = F.linear(x, w, b)
    assert (lin(x) - want).abs().max() < 0.05 * want.abs().max()
    assert (lin.add_to(want, x) - 2 * want).abs().max() < 0.05 * want.abs().max()
    assert (lin.dense() - w).abs().max() <= w.abs().max() / 127
    assert lin.nbytes < w.numel() * 4 / 3
    lin.set_rows(0, 8, torch.zeros(8, 64))
    assert lin.dense()[:8].abs().max() == 0 and lin(x)[:, :8].sub(b[:8]).abs().max() < 1e-5
    lin.bias[:] = 0  # a streamed bias update lands in place
    assert lin(x)[:, :8].abs().max() < 1e-5


@needs_kernel
def test_int8_engine_generates_and_keeps_serving(tiny_dir):
    engine = EmbeddedEngine(tiny_dir, quantization="int8", max_running_requests=4, max_model_len=64)
    try:
        model = engine.model
        assert isinstance(model.layers[0].wqkv, Int8Linear) and isinstance(model.lm_head, Int8Linear)
        assert model.embed.dtype == torch.float32  # the lookup stays fp32
        params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
        outs = engine.generate([[1, 5, 9], [1, 7], [1, 2, 3, 4]], params)
        assert [len(o["output_ids"]) for o in outs] == [6, 6, 6]
        again = engine.generate([1, 5, 9], params)  # greedy and alone: deterministic for the same input
        assert again["output_ids"] == engine.generate([1, 5, 9], params)["output_ids"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("env, why", [
    ({"FINAL_GEMV": "0"}, "FINAL_GEMV=0"),
    ({"CC": "/no/such/gcc"}, "no C compiler"),  # a machine without gcc (a fresh cache: nothing built before)
    ({"FINAL_GEMV_CFLAGS": "-DWIDE=9"}, "could not build"),  # a build that fails
])
def test_int8_without_the_kernel_is_a_config_error_naming_why(tiny_dir, monkeypatch, tmp_path, env, why):
    """No torch fallback with other numbers (fbgemm's 7-bit activations: a teacher-forced KL of 0.24 against the
    kernel's 0.0013): the engine refuses int8 at start, naming the key and the reason."""
    monkeypatch.setenv("FINAL_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_loaded", [])  # this process's kernel is looked up again under env
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as err:
        EmbeddedEngine(tiny_dir, quantization="int8", max_model_len=32)
    assert err.value.key == "rollout.engine_kwargs.local.quantization" and why in str(err.value)
    assert "cannot run here" in str(err.value)


@needs_kernel
def test_int8_runs_on_the_kernel_without_onednn_packing(tiny_dir, monkeypatch):
    """FINAL_PACK_WEIGHTS=0 turns oneDNN's packing off; int8 never used it, so it keeps its kernel."""
    monkeypatch.setenv("FINAL_PACK_WEIGHTS", "0")
    engine = EmbeddedEngine(tiny_dir, quantization="int8", max_model_len=32)
    try:
        assert engine.model.kernel is not None
        assert len(engine.generate([1, 5, 9], {"max_new_tokens": 3, "temperature": 0})["output_ids"]) == 3
    finally:
        engine.shutdown()


def test_int8_refuses_a_matrix_without_whole_blocks(tmp_path, tiny_dir):
    """A model whose matrices the kernel's blocks cannot tile (hidden 48: no multiple of 32) is a ConfigError
    naming the matrix, not a model half on another kernel."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_dir)
    config.hidden_size, config.head_dim = 48, 12
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    from final.engine.model import CausalLM

    if kernels.gemv_kernel() is None:
        pytest.skip("int8 is refused before the shapes where the kernel cannot run")
    with pytest.raises(ConfigError, match=r"self_attn\.q_proj is \[48, 48\]"):
        CausalLM.from_pretrained(str(tmp_path), torch.float32, quantization="int8")


@pytest.mark.parametrize("kwargs, text", [
    ({"quantization": "int4"}, "must be one of"),
    ({"quantization": "int8", "dtype": "bfloat16"}, "float32"),
    ({"quantization": "bf16", "dtype": "bfloat16"}, "float32"),  # weight-only bf16 is for an fp32 model
])
def test_bad_quantization_is_a_config_error_naming_the_key(tiny_dir, kwargs, text):
    with pytest.raises(ConfigError) as err:
        EmbeddedEngine(tiny_dir, max_model_len=32, **kwargs)
    assert err.value.key == "rollout.engine_kwargs.local.quantization" and text in str(err.value)


def test_config_validates_quantization():
    def cfg(value):
        return {"model_path": "builtin:tiny-random-llama", "rollout": {"engine_kwargs": {"local": {
            "quantization": value}}}}

    assert load_config(cfg("int8")).rollout_config().engine_kwargs["local"]["quantization"] == "int8"
    assert load_config(cfg("bf16")).rollout_config().engine_kwargs["local"]["quantization"] == "bf16"
    load_config(cfg(None))
    for bad in ("int4", 8, True):
        with pytest.raises(ConfigError) as err:
            load_config(cfg(bad))
        assert err.value.key == "rollout.engine_kwargs.local.quantization"


@pytest.mark.parametrize("shape", [(1, 1, 576), (8, 1, 576), (2, 37, 64), (3, 5, 4, 64)])
def test_fp32_rms_norm_is_bitwise_hf(shape):
    """The engine's fp32 RMSNorm is torch's fused op; HF's LlamaRMSNorm is the reference, bit for bit."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from final.engine.model import rms_norm

    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g) * 4
    hf = LlamaRMSNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(shape[-1], generator=g))
        assert torch.equal(rms_norm(x, hf.weight, 1e-5), hf(x))
