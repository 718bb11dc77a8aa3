"""The engine's own small-M kernel (final/engine/kernels/gemv.c: fp32, bf16 and int8 weights) against torch, and its
fallbacks."""

from __future__ import annotations

import logging
from array import array

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import assert_same_or_tied, tokens_and_logprobs

from final.engine import kernels
from final.engine.kernels import PREP_GLU, PREP_NORM, Q8_BLOCK, KernelError, dequantize
from final.engine.linear import GEMV_ROWS, INT8_GEMV_ROWS, Bf16Linear, Int8Linear, Linear, gemv_enabled

KERNEL = gemv_enabled(torch.device("cpu"), torch.float32)
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the gemv kernel does not run here (no gcc, AVX2 or oneDNN)")


def assert_same_tokens(got: list, want: list, tol: float) -> None:
    """The same greedy tokens, row by row, and their log-probs within tol."""
    for (ids, lps), (ids0, lps0) in zip(got, want):
        assert ids == ids0
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(lps0), rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])  # bf16: weight-only, widened in registers
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9])  # every activation-row pass width, and a second pass
@pytest.mark.parametrize("n,k", [(37, 40), (64, 576), (5, 3)])  # K tails (40 = 32 + 8; 3 < one vector)
def test_every_prep_and_epilogue_matches_torch(wdtype, threads, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x, gu = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(m, 2 * k, generator=g)
    w = w.to(wdtype)
    bias, res, norm = torch.randn(n, generator=g), torch.randn(m, n, generator=g), torch.randn(k, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # rows split across this many threads (more threads than rows too)
    try:
        got = [KERNEL(x, w), KERNEL(x, w, bias, res), KERNEL(x, w, prep=PREP_NORM, norm=norm, eps=1e-5),
               KERNEL(gu, w, None, res, PREP_GLU)]
    finally:
        torch.set_num_threads(before)
    w = w.float()  # a bf16 weight widens to fp32 exactly: the reference multiplies by that
    inputs = [x, x, F.rms_norm(x, (k,), norm, 1e-5), F.silu(gu[:, :k]) * gu[:, k:]]
    want = [F.linear(x, w), res + F.linear(x, w, bias), F.linear(inputs[2], w), res + F.linear(inputs[3], w)]
    for a, b, inp in zip(got, want, inputs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 + bf16_dp_slack(wdtype, m, inp, w))


def bf16_dp_slack(wdtype: torch.dtype, m: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | float:
    """What an AVX512-BF16 build may differ by beyond fp32 rounding with bf16 weights at up to 4 rows (avx512.h): x
    carried as two bf16 halves, each |x - hi - lo| <= 2^-18 |x|, so each product within 2^-18 |w x| (2^-16: room)."""
    if wdtype != torch.bfloat16 or m > 4 or KERNEL.isa != "avx512bf16":
        return 0.0
    return (x.abs() @ w.abs().T).max().item() * 2.0**-16


@needs_kernel
@pytest.mark.parametrize("m", [1, GEMV_ROWS, GEMV_ROWS + 1, 40])  # the kernel, and oneDNN on the same dense weight
def test_linear_routes_by_rows_and_keeps_one_dense_copy(m):
    w, b = torch.randn(96, 40), torch.randn(96)
    lin = Linear(w.clone(), b, pack=True, gemv=KERNEL)
    assert lin.weight is not None and lin.packed is None  # no oneDNN reorder beside it
    assert lin.fuses(m) == (m <= GEMV_ROWS)
    x, r = torch.randn(m, 1, 40), torch.randn(m, 1, 96)
    torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lin.add_to(r, x), r + F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    new = torch.randn(16, 40)
    lin.set_rows(8, 24, new)  # a streamed weight update lands in the one dense tensor
    w[8:24] = new
    torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


@needs_kernel
def test_fused_norm_and_swiglu_through_linear():
    norm, eps = torch.randn(40), 1e-6
    up, down = Linear(torch.randn(64, 40), gemv=KERNEL), Linear(torch.randn(40, 32), gemv=KERNEL)
    x = torch.randn(3, 1, 40)
    gate_up = up.normed(x, norm, eps)
    torch.testing.assert_close(gate_up, F.linear(F.rms_norm(x, (40,), norm, eps), up.weight), rtol=1e-4, atol=1e-4)
    gate, u = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(down.glu_add_to(x, gate_up), x + F.linear(F.silu(gate) * u, down.weight),
                               rtol=1e-4, atol=1e-4)


def test_a_kernel_that_cannot_be_built_leaves_torch_kernels(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("FINAL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-gcc"))
    with pytest.raises(KernelError, match="could not build gemv.c|no-such-gcc"):
        kernels.build()
    with caplog.at_level(logging.WARNING, logger="final.engine.kernels"):
        assert kernels._load()[0] is None
    assert "using torch's kernels" in caplog.text and not list(tmp_path.glob("kernels/*.so"))


def test_final_gemv_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("FINAL_GEMV", "0")
    assert kernels.gemv_kernel() is None and gemv_enabled(torch.device("cpu"), torch.float32) is None
    assert gemv_enabled(torch.device("cpu"), torch.bfloat16) is None  # fp32 only, whatever the flag


ISAS_HERE = kernels.candidate_isas() if KERNEL is not None else []


@needs_kernel
def test_int8_is_weight_only_with_a_scale_per_32_and_takes_updates():
    """With the kernel, int8 has a scale per 32 weights and near-exact activations (int16 per 32-block, ~1e-5 of
    the block's largest) at every row count (a prompt's too): each matches the dequantized weight to ~1e-4 of the
    output's scale, and an outlier costs only its own block's precision."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    w[:, 5] *= 30  # an outlier column
    lin = Int8Linear(w.clone(), b.clone(), gemv=KERNEL)
    assert lin.scale.shape == (48, 64 // Q8_BLOCK)
    deq = dequantize(lin.q, lin.scale)
    assert torch.equal(lin.dense(), deq)
    per_row = (w.abs().amax(dim=1, keepdim=True) / 127)
    assert (deq - w)[:, 32:].abs().max() < (torch.round(w / per_row) * per_row - w)[:, 32:].abs().max() / 4
    assert INT8_GEMV_ROWS is None
    for m in (1, 5, 16, 37):  # one pass of activation rows, a part pass, several passes
        x, r = torch.randn(m, 1, 64, generator=g), torch.randn(m, 1, 48, generator=g)
        assert lin.fuses(m)
        want = F.linear(x, deq, b)
        tol = 1e-4 * want.abs().max().item()
        torch.testing.assert_close(lin(x), want, rtol=0, atol=tol)
        torch.testing.assert_close(lin.add_to(r, x), r + want, rtol=0, atol=tol)
    # the fused RMSNorm and SwiGLU quantize the activations they write (no quantizing phase of the product's own)
    norm, x, gate_up = torch.randn(64, generator=g), torch.randn(3, 1, 64, generator=g), torch.randn(3, 1, 128,
                                                                                                   generator=g)
    want = F.linear(F.rms_norm(x, (64,), norm, 1e-5), deq, b)
    torch.testing.assert_close(lin.normed(x, norm, 1e-5), want, rtol=0, atol=1e-4 * want.abs().max().item())
    r = torch.randn(3, 1, 48, generator=g)
    want = r + F.linear(F.silu(gate_up[..., :64]) * gate_up[..., 64:], deq, b)
    torch.testing.assert_close(lin.glu_add_to(r, gate_up), want, rtol=0, atol=1e-4 * want.abs().max().item())
    lin.set_rows(0, 8, torch.zeros(8, 64))  # a weight update: those rows change, the others keep their values
    assert lin.dense()[:8].abs().max() == 0 and torch.equal(lin.dense()[8:], deq[8:])
    with pytest.raises(ValueError, match="rows of 32s"):  # 40 is no multiple of 32
        Int8Linear(torch.randn(16, 40), gemv=KERNEL)
    with pytest.raises(ValueError, match="groups of 16"):  # 40 rows are no whole groups of 16
        Int8Linear(torch.randn(40, 64), gemv=KERNEL)


def use_isa(isa: str | None, monkeypatch) -> None:
    """Engines made after this run `isa`'s build (None: the default one), or the test skips where the CPU cannot."""
    if isa is not None:
        if isa not in ISAS_HERE:
            pytest.skip(f"this CPU does not list what the {isa} build needs")
        monkeypatch.setattr(kernels, "_loaded", [kernels.load(isa)])


@needs_kernel
@pytest.mark.parametrize("arch,quantization,isa", [
    ("llama", None, None), ("qwen2", None, None), ("qwen3", None, None),  # qwen2: the qkv bias; qwen3: qk-norm
    ("llama", "bf16", None), ("qwen2", "bf16", None), ("llama", "bf16", "avx2"), ("llama", None, "avx2")])
def test_whole_decode_layers_in_the_kernel_match_the_torch_forward(arch, quantization, isa, monkeypatch):
    """The kernel's whole-layer decode (RMSNorm, q|k|v, RoPE, the cache write, attention, o, SwiGLU, down) against
    the engine with torch's kernels on the same weights: log-probs of every generated token, rows of different
    lengths decoding together. bf16: the same bf16 weights, widened for F.linear without the kernel. (int8's
    products are checked against the dequantized weight above; the same C layer code runs them.)"""
    from final.engine import EmbeddedEngine
    from final.models import resolve_model_path

    use_isa(isa, monkeypatch)
    path = resolve_model_path(f"builtin:tiny-random-{arch}")
    prompts = [[1, 5, 6, 7], [1] + list(range(30, 60))]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    got = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("FINAL_GEMV", flag)
        engine = EmbeddedEngine(path, max_model_len=64, quantization=quantization)
        try:
            assert (engine.model.kernel is not None) == (flag == "1")
            assert flag == "0" or isa is None or engine.model.kernel.isa == isa
            if quantization:
                model = engine.model
                assert isinstance(model.layers[0].wo, Bf16Linear) and isinstance(model.lm_head, Bf16Linear)
            outs = engine.generate(prompts, params, return_logprob=True)
            got[flag] = tokens_and_logprobs(outs)
        finally:
            engine.shutdown()
    assert_same_tokens(got["1"], got["0"], 1e-4)


@needs_kernel
@pytest.mark.parametrize("arch,isa", [("llama", None), ("qwen2", None), ("llama", "avx2")])
def test_int8_whole_layers_match_the_kernels_product_by_product_path(arch, isa, monkeypatch):
    """int8's whole-layer decode against the same engine running the layer loop with one kernel call per product
    (torch between them)."""
    from final.engine import EmbeddedEngine
    from final.engine.attention import DecodePlan
    from final.models import resolve_model_path

    use_isa(isa, monkeypatch)
    path = resolve_model_path(f"builtin:tiny-random-{arch}")
    prompts = [[1, 5, 6, 7], [1] + list(range(30, 60))]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    got = {}
    for whole in (True, False):
        if not whole:  # every plan product by product
            monkeypatch.setattr(DecodePlan, "fuses_layers", property(lambda _plan: False))
        engine = EmbeddedEngine(path, max_model_len=64, quantization="int8")
        try:
            assert engine.model.kernel is not None and (isa is None or engine.model.kernel.isa == isa)
            got[whole] = engine.generate(prompts, params, return_logprob=True, top_logprobs_num=2)
        finally:
            engine.shutdown()
    # 1e-3: the two paths' attention differs in fp32 rounding, which can move an activation across an int16
    # rounding step (2.7e-4 on llama's second row; qwen2's second row has two tokens tied within 6e-5 at step 4)
    assert_same_or_tied(got[True], got[False], 1e-3)


@needs_kernel
@pytest.mark.parametrize("quantization", [None, "int8", "bf16"])
def test_whole_layers_give_the_same_bits_on_any_number_of_threads(quantization):
    """Every output row of a product and every head's attention is one thread's work with the same loop, so the
    team's size changes no bit; a phase that read its input before the kernel's barrier (products.h sync_team)
    let every thread finish writing it would. 3 threads on this machine's cores oversubscribe them too."""
    from final.engine import EmbeddedEngine
    from final.models import resolve_model_path

    engine = EmbeddedEngine(resolve_model_path("builtin:tiny-random-llama"), max_model_len=64,
                            quantization=quantization)
    outs = {}
    try:
        assert engine.model.kernel is not None
        for threads in (1, 2, 3):
            engine.call(lambda _runner, t=threads: torch.set_num_threads(t))
            outs[threads] = tokens_and_logprobs(engine.generate([[1, 5, 6, 7], [1, 9, 8]],
                                                               {"max_new_tokens": 12, "temperature": 0,
                                                                "ignore_eos": True}, return_logprob=True))
    finally:
        engine.shutdown()
    assert outs[1] == outs[2] == outs[3]


@needs_kernel
def test_rows_with_cartridges_decode_in_the_kernel_as_in_the_torch_forward(monkeypatch):
    """Rows with different cartridges (one, another, a composition of both) and a row with none decode together in
    the kernel's whole-layer path (each row's prefix attended before its own tokens in one softmax) as the torch
    forward does them (prefix and own tokens as two segments merged by log-sum-exp)."""
    from final.engine import EmbeddedEngine
    from final.models import resolve_model_path

    path = resolve_model_path("builtin:tiny-random-llama")
    prompts = [[1, 5, 6, 7], [1] + list(range(30, 45)), [1, 9], [1, 2, 3]]
    cartridges = ["a", "b", None, ["a", "b"]]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    got = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("FINAL_GEMV", flag)
        engine = EmbeddedEngine(path, max_model_len=96)
        try:
            spec, g = engine.spec, torch.Generator().manual_seed(3)
            for cid, p in (("a", 5), ("b", 12)):
                shape = (1, spec.num_kv_heads, p, spec.head_dim)
                kv = [[torch.randn(shape, generator=g) for _ in range(spec.num_layers)] for _ in range(2)]
                engine.load_cartridge(cid, *kv)
            outs = engine.generate(prompts, params, return_logprob=True, cartridges=cartridges)
            got[flag] = tokens_and_logprobs(outs)
        finally:
            engine.shutdown()
    assert_same_tokens(got["1"], got["0"], 1e-4)
    assert len({tuple(ids) for ids, _ in got["1"][:3]}) == 3  # the prefixes change what the rows say


@pytest.mark.parametrize("kernel", [KERNEL, None], ids=["kernel", "no-kernel"])
def test_bf16_is_weight_only_routes_by_rows_and_takes_updates(kernel):
    """quantization: bf16 keeps one bf16 copy of W (half fp32's bytes); every row count gives F.linear by the weight
    widened to fp32 (exact), with fp32 activations and sums; a weight update is rounded to bf16 in place."""
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(48, 40, generator=g), torch.randn(48, generator=g)
    lin = Bf16Linear(w.bfloat16(), b, gemv=kernel)
    assert lin.weight is None and lin.nbytes == 48 * 40 * 2 + 48 * 4
    ref = w.bfloat16().float()
    for m in (1, GEMV_ROWS, GEMV_ROWS + 1, 40):
        x, r = torch.randn(m, 1, 40, generator=g), torch.randn(m, 1, 48, generator=g)
        assert lin.fuses(m) == (kernel is not None and m <= GEMV_ROWS)
        tol = 1e-5 + (bf16_dp_slack(torch.bfloat16, m, x[:, 0], ref) if kernel is not None else 0.0)
        torch.testing.assert_close(lin(x), F.linear(x, ref, b), rtol=1e-5, atol=tol)
        torch.testing.assert_close(lin.add_to(r, x), r + F.linear(x, ref, b), rtol=1e-5, atol=tol)
    address = lin.w16.data_ptr()
    new = torch.randn(8, 40, generator=g)
    lin.set_rows(8, 16, new)
    assert lin.w16.data_ptr() == address and torch.equal(lin.dense()[8:16], new.bfloat16().float())
    assert torch.equal(lin.dense()[16:], ref[16:])
    with pytest.raises(ValueError, match="bfloat16"):
        Bf16Linear(w, b)


def test_the_weight_arena_aligns_copies_and_refuses_overflow():
    from final.engine.arena import HUGE, WeightArena

    a, b = torch.randn(3, 5), torch.randint(-5, 5, (7,), dtype=torch.int8)
    arena = WeightArena(WeightArena.size([a.nbytes, b.nbytes]))
    ca, cb = arena.take(a), arena.take(b)
    assert torch.equal(ca, a) and torch.equal(cb, b) and ca.dtype == a.dtype and cb.shape == b.shape
    assert ca.data_ptr() % HUGE == 0 and cb.data_ptr() % 64 == 0  # a 2 MB boundary, then cache lines
    with pytest.raises(ValueError, match="arena full"):
        arena.take(torch.zeros(2))


@needs_kernel
def test_a_weight_update_reaches_the_kernels_int8_weights(tiny_dir):
    """load_hf_weight quantizes an int8 matrix anew (into its place in the weight arena): the whole-step call must
    read the new values."""
    from final.engine import EmbeddedEngine

    engine = EmbeddedEngine(tiny_dir, quantization="int8", max_model_len=64)
    try:
        params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
        engine.generate([1, 5, 6], params)
        model = engine.model
        down = model.layers[0].w_down
        engine.call(lambda _r: model.load_hf_weight("model.layers.0.mlp.down_proj.weight",
                                                   torch.zeros(down.out_features, down.in_features)))
        assert int(model._kernel_tables()[0][0, 3]) == down.q.data_ptr() and down.q.abs().max() == 0
        assert len(engine.generate([1, 5, 6], params)["output_ids"]) == 4  # and it serves on the new weights
    finally:
        engine.shutdown()


@needs_kernel
def test_a_model_with_one_product_off_the_kernel_runs_none_fused():
    """A model where one matrix is off the kernel must not take the fused paths (their address table would hold
    no weight for it)."""
    from final.engine.model import CausalLM
    from final.models import resolve_model_path

    model = CausalLM.from_pretrained(resolve_model_path("builtin:tiny-random-llama"), torch.float32,
                                     quantization="int8")
    assert model.kernel is not None
    model.layers[1].w_down.gemv = None
    again = CausalLM(model.spec, model.embed, model.lm_head, model.norm, model.layers, model.cos, model.sin,
                     tied=model.tied)
    assert again.kernel is None


@needs_kernel
def test_the_kernels_decode_step_refuses_an_id_or_position_past_its_tables():
    """The one-call decode step reads the embedding and rope rows itself: an id or position past them is an
    IndexError naming the row before anything runs (torch's indexing would raise too), and the model decodes on."""
    from final.engine.attention import DecodePlan
    from final.engine.kv_cache import KVCache
    from final.engine.model import CausalLM
    from final.models import resolve_model_path

    model = CausalLM.from_pretrained(resolve_model_path("builtin:tiny-random-llama"), torch.float32)
    spec = model.spec
    cache = KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, torch.float32, torch.device("cpu"), 8)
    cache.reserve(2, 8)

    def decode(ids: list[int], positions: list[int]) -> torch.Tensor:
        return model.decode(DecodePlan(cache, array("q", ids + positions + [0, 0]), [], spec.head_dim ** -0.5))

    with pytest.raises(IndexError, match="decode row 1: token id 99999"):
        decode([3, 99999], [0, 0])
    with pytest.raises(IndexError, match="decode row 0: .* position 1000000"):
        decode([3, 4], [1_000_000, 0])
    logits = decode([3, 4], [0, 0])
    assert logits.shape == (2, model.lm_head.out_features) and bool(torch.isfinite(logits).all())
