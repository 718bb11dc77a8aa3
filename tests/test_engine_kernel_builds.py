"""The kernel's builds (one per instruction set the CPU lists), how the loader picks among them, and int8's
interleaved storage. The products and whole layers of the default build: test_engine_gemv.py."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from final.engine import kernels
from final.engine.kernels import builds
from final.engine.kernels import KernelError, dequantize
from test_engine_gemv import ISAS_HERE, KERNEL, bf16_dp_slack, needs_kernel


@needs_kernel
@pytest.mark.parametrize("isa", list(kernels.ISAS))
def test_every_instruction_set_this_cpu_runs_matches_torch(isa):
    """Each build the CPU can run (avx2 everywhere the kernel runs; avx512 and avx512bf16 where the CPU lists them)
    against torch: fp32, bf16 and int8 weights, every activation-row pass width, one and two threads."""
    if isa not in ISAS_HERE:
        pytest.skip(f"this CPU does not list what the {isa} build needs")
    k = kernels.load(isa)
    assert k.isa == isa and f"gemv-{isa}-" in k.path.name
    g = torch.Generator().manual_seed(7)
    before = torch.get_num_threads()
    try:
        for threads, m, (n, kk) in [(t, m, s) for t in (1, 2) for m in (1, 2, 3, 4, 5, 8, 16) for s in ((37, 64), (70, 576))]:
            torch.set_num_threads(threads)
            x, w, bias = torch.randn(m, kk, generator=g), torch.randn(n, kk, generator=g), torch.randn(n, generator=g)
            q, scale = kernels.quantize(w[: n - n % 16] if n % 16 else w)
            for weight, ref, kw in ((w, w, {}), (w.bfloat16(), w.bfloat16().float(), {}),
                                    (q, dequantize(q, scale), {"scale": scale})):
                want = F.linear(x, ref, bias[: ref.shape[0]])
                slack = bf16_dp_slack(weight.dtype, m, x, ref) if isa == "avx512bf16" else 0.0
                tol = (1e-4 * want.abs().max().item() if weight.dtype == torch.int8 else 1e-4) + slack
                torch.testing.assert_close(k(x, weight, bias[: ref.shape[0]], **kw), want, rtol=1e-4, atol=tol)
    finally:
        torch.set_num_threads(before)


def test_the_builds_tried_follow_the_cpus_flags_and_final_gemv_isa(monkeypatch, caplog):
    monkeypatch.delenv("FINAL_GEMV_ISA", raising=False)
    monkeypatch.setattr(builds, "cpu_flags", lambda: {"avx2", "fma", "sse4_2"})
    assert kernels.candidate_isas() == ["avx2"]
    monkeypatch.setattr(builds, "cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
    assert kernels.candidate_isas() == ["avx512", "avx2"]
    monkeypatch.setenv("FINAL_GEMV_ISA", "avx2")
    assert kernels.candidate_isas() == ["avx2"]
    monkeypatch.setenv("FINAL_GEMV_ISA", "sse9")
    with pytest.raises(KernelError, match="FINAL_GEMV_ISA='sse9'"):
        kernels.candidate_isas()
    with caplog.at_level(logging.WARNING, logger="final.engine.kernels"):
        assert kernels._load()[0] is None
    assert "FINAL_GEMV_ISA='sse9'" in caplog.text


@needs_kernel
def test_a_build_that_fails_falls_back_to_the_next(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "candidate_isas", lambda: ["avx512", "avx2"])
    real = kernels.build

    def build(isa="avx2"):
        if isa == "avx512":
            raise KernelError("gcc 9 has no -mavx512bf16 (a stand-in failure)")
        return real(isa)

    monkeypatch.setattr(kernels, "build", build)
    with caplog.at_level(logging.INFO, logger="final.engine.kernels"):
        kernel, _ = kernels._load()
    assert kernel is not None and kernel.isa == "avx2"
    assert "runs the avx2 build" in caplog.text and "stand-in failure" in caplog.text


def test_int8_weights_are_stored_16_rows_side_by_side_and_read_back_exactly():
    """quantize() interleaves 16 output rows with k in pairs (the kernel's vector lanes); dequantize() undoes it,
    row for row against the plain per-row quantization."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 64, generator=g)
    q, scale = kernels.quantize(w)
    blocks = w.view(32, 2, 32)
    plain_scale = (blocks.abs().amax(-1) / 127).clamp_min(1e-12)
    plain = torch.round(blocks / plain_scale[..., None]).clamp(-127, 127).to(torch.int8).view(32, 64)
    assert q.shape == (32, 64) and scale.shape == (32, 2)
    assert torch.equal(q.view(2, 32, 16, 2)[1, 5, 3], plain[16 + 3, 10:12])  # group 1, pair 5, row 3 of the group
    assert torch.equal(scale.view(2, 2, 16)[0, 1, 7], plain_scale[7, 1])
    want = (plain.view(32, 2, 32) * plain_scale[..., None]).view(32, 64)
    torch.testing.assert_close(kernels.dequantize(q, scale), want, rtol=0, atol=0)


@needs_kernel
@pytest.mark.skipif(not ISAS_HERE, reason="no build of the kernel runs here")
def test_a_phase_timing_build_counts_every_phase_and_decodes_the_same_bits(monkeypatch):
    """FINAL_GEMV_CFLAGS=-DFINAL_PHASES (bench/profile_decode.py --phases) builds a kernel of its own that counts
    each decode-layer phase's cycles per thread; the engine's build counts nothing, and both decode alike."""
    from final.engine import EmbeddedEngine
    from final.models import resolve_model_path

    isa = ISAS_HERE[0]
    plain = kernels.load(isa)
    monkeypatch.setenv("FINAL_GEMV_CFLAGS", "-DFINAL_PHASES")
    timed = kernels.load(isa)
    assert plain.phase_cycles() is None and timed.path != plain.path
    got = {}
    for kernel in (plain, timed):
        monkeypatch.setattr(kernels, "_loaded", [kernel])
        engine = EmbeddedEngine(resolve_model_path("builtin:tiny-random-llama"), max_model_len=64)
        try:
            got[kernel.path] = engine.generate([[1, 5, 6, 7]], {"max_new_tokens": 6, "temperature": 0,
                                                                "ignore_eos": True}, return_logprob=True)
        finally:
            engine.shutdown()
    cycles = timed.phase_cycles()
    assert cycles is not None and bool((cycles[0, 0] > 0).all())  # thread 0 ran every phase
    assert bool((cycles[:, 1] <= cycles[:, 0]).all())  # waiting is part of a phase's time
    want, have = (got[k.path][0]["meta_info"] for k in (plain, timed))
    assert want["output_token_logprobs"] == have["output_token_logprobs"]
