"""The embedded engine's CPU fast paths keep HF's numerics: prepacked weights, rope, fused residual, bf16."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from final.engine import EmbeddedEngine
from final.engine.attention import attend_lse, attend_prefix
from final.engine.kv_cache import PrefixKV
from final.engine.linear import Linear, gemv_enabled, packing_enabled
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_f_linear_and_updates(dtype):
    if not packing_enabled(torch.device("cpu"), dtype):  # bf16 packing needs AVX-512 or AVX-NE-CONVERT
        pytest.skip(f"oneDNN {dtype} weight prepacking is not available on this CPU / PyTorch build")
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


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("p", [100, 512, 1001])  # one chunk; chunks of equal size; chunks plus a tail
def test_prefix_attention_split_by_keys_is_exact(p, threads, dtype, tol):
    g = torch.Generator().manual_seed(p)
    qg = torch.randn(2, 3, 3, 5, 64, generator=g).to(dtype)  # [rows, kv heads, group, tokens, head dim]
    k, v = (torch.randn(3, p, 64, generator=g).to(dtype) for _ in range(2))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # one chunk of keys per thread
    try:
        o, lse = attend_prefix(qg, PrefixKV(("c",), [k], [v]), 0, 0.125)
    finally:
        torch.set_num_threads(before)
    flat = qg.float().permute(1, 0, 2, 3, 4).reshape(3, 30, 64)
    want_o, want_lse = attend_lse(flat, k.float(), v.float(), 0.125)
    assert o.dtype == dtype
    torch.testing.assert_close(o.float().permute(1, 0, 2, 3, 4).reshape(3, 30, 64), want_o, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.permute(1, 0, 2, 3).reshape(3, 30), want_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prompts", [[[1, 5, 6, 7], [1] + list(range(30, 70)), [1, 9]],  # 3 rows: the gemv kernel
                                     [[1, 5 + i, 6, 7] for i in range(12)]])  # 12: oneDNN on the dense weight
def test_every_cpu_kernel_gives_the_same_greedy_tokens(tiny_dir, monkeypatch, prompts):
    """The gemv kernel (default where it builds), oneDNN packed (FINAL_GEMV=0), dense F.linear (FINAL_PACK_WEIGHTS=0)."""
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    outs = []
    for gemv, pack in (("1", "1"), ("0", "1"), ("0", "0")):
        monkeypatch.setenv("FINAL_GEMV", gemv)
        monkeypatch.setenv("FINAL_PACK_WEIGHTS", pack)
        engine = EmbeddedEngine(tiny_dir)
        try:
            lin = engine.model.layers[0].wqkv
            expect_gemv = gemv == "1" and gemv_enabled(torch.device("cpu"), torch.float32) is not None
            assert (lin.gemv is not None) == expect_gemv
            assert (lin.packed is not None) == (not expect_gemv and pack == "1" and packing_enabled(
                torch.device("cpu"), torch.float32))
            outs.append([o["output_ids"] for o in engine.generate(prompts, params)])
        finally:
            engine.shutdown()
    assert outs[0] == outs[1] == outs[2]


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
