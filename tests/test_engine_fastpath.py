"""The embedded engine's CPU fast paths keep HF's numerics: prepacked weights, rope, fused residual, bf16."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from final.engine import EmbeddedEngine
from final.engine.linear import Linear, packing_enabled
from final.engine.model import rms_norm, rope

needs_packing = pytest.mark.skipif(not packing_enabled(torch.device("cpu"), torch.float32),
                                   reason="oneDNN weight prepacking is not available in this PyTorch build")


def test_rope_is_bitwise_hf_rotate_half():
    x = torch.randn(3, 5, 7, 64)
    cos, sin = torch.randn(3, 5, 1, 64), torch.randn(3, 5, 1, 64)
    x1, x2 = x.chunk(2, dim=-1)
    want = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    sin_signed = torch.cat((-sin[..., :32], sin[..., 32:]), dim=-1)
    assert torch.equal(rope(x, cos, sin_signed), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_bitwise_hf(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96))
    for scale in (1e-3, 1.0, 1e3):
        x = (torch.randn(4, 3, 96) * scale).to(dtype)
        assert torch.equal(rms_norm(x, hf.weight.detach(), 1e-6), hf(x))


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_f_linear_and_updates(dtype):
    w, b = torch.randn(96, 40, dtype=dtype), torch.randn(96, dtype=dtype)
    lin = Linear(w.clone(), b, pack=True)
    assert lin.packed is not None and lin.weight is None  # no second dense copy is kept
    x = torch.randn(5, 3, 40, dtype=dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(lin(x).float(), torch.nn.functional.linear(x, w, b).float(), atol=tol, rtol=tol)
    assert torch.equal(lin.dense(), w)
    new = torch.randn(16, 40, dtype=dtype)
    lin.set_rows(8, 24, new)  # a streamed weight update: repacked on the next call
    w[8:24] = new
    assert torch.allclose(lin(x).float(), torch.nn.functional.linear(x, w, b).float(), atol=tol, rtol=tol)
    assert lin.packed is not None


@needs_packing
def test_fused_residual_is_bitwise_in_fp32():
    lin = Linear(torch.randn(64, 128), pack=True)
    x, r = torch.randn(7, 1, 128), torch.randn(7, 1, 64)
    assert torch.equal(lin.add_to(r, x), r + lin(x))


def test_unpacked_engine_gives_the_same_greedy_tokens(tiny_dir, monkeypatch):
    prompts = [[1, 5, 6, 7], [1] + list(range(30, 70)), [1, 9]]
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("FINAL_PACK_WEIGHTS", flag)
        engine = EmbeddedEngine(tiny_dir)
        try:
            assert (engine.model.layers[0].wqkv.packed is not None) == (flag == "1" and packing_enabled(
                torch.device("cpu"), torch.float32))
            outs.append([o["output_ids"] for o in engine.generate(prompts, params)])
        finally:
            engine.shutdown()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bf16_single_prompt_greedy_matches_hf_bf16(arch):
    """In bf16 a batch's rounding depends on its size (HF's too), so parity is checked one prompt at a time."""
    from final.models import resolve_model_path

    path = resolve_model_path(f"builtin:tiny-random-{arch}")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    engine = EmbeddedEngine(path, dtype="bfloat16")
    try:
        for prompt in ([1, 5, 6, 7, 8, 9], [1] + list(range(100, 140))):
            out = engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
            with torch.inference_mode():
                ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=2)
            assert out["output_ids"] == ref[0, len(prompt):].tolist()
    finally:
        engine.shutdown()
