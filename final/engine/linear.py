"""Weight matrices of the embedded engine, and which CPU kernel multiplies by them at each row count.

On CPU, PyTorch's `F.linear` hands a decode step's small-M products (M = running rows) to MKL's sgemm on a
plain row-major weight, which reaches 10-16 GB/s on the machines measured; oneDNN on a weight reordered once
into its blocked layout 17-42 GB/s (bench/gemv.py, bench/RESULTS.md). Three ways, chosen at load time:
- fp32 with the engine's own kernel (final/engine/kernels, `gemv`): the weight stays dense and row-major; up to
  GEMV_ROWS rows go through the kernel (which also fuses the RMSNorm or SwiGLU before, and the residual add
  after, a product), more rows (prefill, big batches) through oneDNN on that same dense tensor. One copy.
- `pack`: the weight reordered once into oneDNN's layout, the dense copy dropped (bf16; fp32 without the kernel).
- neither: F.linear on the dense weight (another device, no oneDNN, or a packed product that disagreed).
Weight-only modes (`quantization`, the activations and sums stay fp32): Int8Linear (int8 + a scale per 32, on the
kernel only) and Bf16Linear (bf16), each half or a quarter of fp32's bytes for decode to stream.
"""

from __future__ import annotations

import logging
import os
import threading

import torch
import torch.nn.functional as F

from final.engine.arena import WeightArena
from final.engine.kernels import PREP_GLU, PREP_NONE, PREP_NORM, Q8_BLOCK, Q8_ROWS, GemvKernel, gemv_kernel
from final.engine.kernels import dequantize, quantize as kernel_quantize

logger = logging.getLogger(__name__)

_PACK_BATCH = 32  # oneDNN's layout hint; measured flat across M in 1..32 for these shapes
_EXACT_ROWS = 32  # up to here every row count has its own kernel: decode batches, no padding
GEMV_ROWS = 8  # rows the gemv kernel takes; above, oneDNN is ahead (bench/gemv.py: 8 rows even, 16 rows 0.7x)
# int8 runs every row count on the kernel: it was ahead of oneDNN on the weight dequantized per call at every prompt
# length measured (2-core EPYC, SmolLM2 prefill: 2.6x at 31 tokens, 1.3x at 1024; 1.9x and 1.1x on the AVX2 build)
INT8_GEMV_ROWS = None


def padded_rows(m: int) -> int:
    """The rows a packed product runs with. oneDNN builds (JIT) and caches one kernel per input shape, about
    0.5 MB each and up to 1024 of them per process (plus ideep's cache beside it): as the running batch and the
    prompt lengths of a server vary, its memory crept up by hundreds of MB (the soak in bench/RESULTS.md). Above
    32 rows, eight sizes per octave (zero rows added: at most 12.5%, 6% on average) keep it to about 100 kernels
    per weight shape up to 8192 rows. Measured on SmolLM2: a 1100-token prefill pays ~5%, decode of <= 32 rows 0."""
    if m <= _EXACT_ROWS:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


def packing_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN prepacking: CPU, fp32/bf16, oneDNN built in; FINAL_PACK_WEIGHTS=0 turns it off. bf16 packing also
    needs the CPU's bf16 support (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): on an AVX2-only CPU oneDNN refuses it."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and os.environ.get("FINAL_PACK_WEIGHTS", "1") != "0"
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and (dtype != torch.bfloat16 or _cpu_has_bf16()))


def gemv_enabled(device: torch.device, dtype: torch.dtype) -> GemvKernel | None:
    """The gemv kernel for a model of this device and dtype (fp32 on CPU, beside oneDNN for the larger products),
    or None: the kernel cannot run here (logged once), FINAL_GEMV=0, or oneDNN is missing."""
    if device.type != "cpu" or dtype != torch.float32 or not packing_enabled(device, dtype):
        return None
    return gemv_kernel()


def _cpu_has_bf16() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)  # torch's own probe of the CPU
    return bool(check()) if check is not None else False


class _Gemv:
    """The gemv kernel's calls, shared by Linear (fp32), Int8Linear (int8 + block scales) and Bf16Linear: `gemv_rows`
    rows at most, on the weight each class's `_gemv_weight()` names (and `_gemv_scale()`)."""

    gemv: GemvKernel | None
    gemv_rows: int | None  # None: any
    bias: torch.Tensor | None
    out_features: int

    def fuses(self, m: int) -> bool:
        """Whether a product of m rows runs on the gemv kernel (so normed/glu_add_to may be used)."""
        return self.gemv is not None and (self.gemv_rows is None or m <= self.gemv_rows)

    def _kernel(self, x: torch.Tensor, res: torch.Tensor | None = None, prep: int = PREP_NONE,
                norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
        m, n = x.numel() // x.shape[-1], self.out_features
        y = self.gemv(x.reshape(m, x.shape[-1]).contiguous(), self._gemv_weight(), self.bias,
                      res.reshape(m, n).contiguous() if res is not None else None, prep, norm, eps,
                      scale=self._gemv_scale())
        return y.view(*x.shape[:-1], n)

    def normed(self, x: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
        """self(rms_norm(x, norm, eps)) in one kernel call; only where fuses(rows of x)."""
        return self._kernel(x, prep=PREP_NORM, norm=norm, eps=eps)

    def glu_add_to(self, residual: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """residual + self(silu(gate) * up), gate|up the halves of gate_up's last dim, in one kernel call; only where
        fuses(rows)."""
        return self._kernel(gate_up, res=residual, prep=PREP_GLU).view(residual.shape)

    def _gemv_scale(self) -> torch.Tensor | None:
        return None

    def set_row_blocks(self, blocks: list[tuple[int, int, torch.Tensor]]) -> None:
        """Several set_rows of one update (e.g. q, k and v of a fused q|k|v)."""
        for lo, hi, value in blocks:
            self.set_rows(lo, hi, value)


class Linear(_Gemv):
    """y = x @ W.T (+ b), W [out, in]. `dense()` gives W back; `set_rows()` updates part of it in place."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = False,
                 gemv: GemvKernel | None = None):
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.dtype, self.device = weight.dtype, weight.device
        self.weight: torch.Tensor | None = weight  # dense, or None when packed
        self.packed: torch.Tensor | None = None
        # the gemv kernel (small M) and oneDNN on the same dense weight (the rest): fp32 on CPU only
        self.gemv = gemv if weight.dtype == torch.float32 and weight.device.type == "cpu" else None
        self.gemv_rows = GEMV_ROWS
        self._want_pack = pack and self.gemv is None
        if self._want_pack:
            self._pack(weight)

    def _pack(self, weight: torch.Tensor) -> None:
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_BATCH)
            x = torch.randn(3, self.in_features, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
            x = x.to(self.dtype)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "").float()
            want = F.linear(x, weight).float()
            tol = 1e-3 if self.dtype == torch.float32 else 5e-2
            if not torch.allclose(got, want, rtol=tol, atol=tol):
                raise RuntimeError(f"packed product differs from F.linear by {(got - want).abs().max().item():.3g}")
        except Exception as exc:  # noqa: BLE001 - a missing or misbehaving kernel is a speed loss, not an error
            logger.warning("oneDNN weight prepacking unavailable (%s); using dense F.linear", exc)
            self.weight, self.packed, self._want_pack = weight, None, False
            return
        self.packed, self.weight = packed, None

    def _gemv_weight(self) -> torch.Tensor:
        return self.weight

    def _onednn(self) -> torch.Tensor | None:
        """The tensor oneDNN multiplies by: the packed weight, or (beside the gemv kernel) the dense one."""
        return self.packed if self.packed is not None else self.weight if self.gemv is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.numel() // x.shape[-1]
        if self.fuses(m):
            return self._kernel(x)
        if (w := self._onednn()) is not None:
            return _onednn_product(x, m, w, self.bias)
        if self._want_pack:  # updated since the last use: reorder once, not once per streamed slice
            self._pack(self.weight)
            return self(x)
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x). In fp32 the kernels add in the product's epilogue (one op; oneDNN's is bitwise the
        same result, the gemv kernel's is res + dot as well); in bf16 the separate add keeps HF's rounding."""
        m = x.numel() // x.shape[-1]
        if self.fuses(m):
            return self._kernel(x, res=residual)
        if (w := self._onednn()) is not None and self.dtype == torch.float32:
            if padded_rows(m) == m:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, w, self.bias, "add")
            out = torch.ops.mkldnn._linear_pointwise.binary(_padded(x, m), _padded(residual, m), w, self.bias,
                                                            "add")
            return out[:m].reshape(residual.shape)
        return residual + self(x)

    def dense(self) -> torch.Tensor:
        """The weight [out, in] in the ordinary layout (a fresh tensor when packed)."""
        return self.weight if self.packed is None else self.packed.to_dense()

    def set_rows(self, lo: int, hi: int, value: torch.Tensor) -> None:
        """Overwrite rows lo:hi of W (a trainer's weight update streamed into a fused matrix)."""
        if self.packed is not None:
            self.weight, self.packed = self.packed.to_dense(), None  # repacked lazily on the next call
        self.weight[lo:hi].copy_(value)

    @property
    def nbytes(self) -> int:
        t = self.packed if self.packed is not None else self.weight
        n = t.numel() * t.element_size()
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)


def _onednn_product(x: torch.Tensor, m: int, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T (+ bias) on oneDNN (w packed or dense), its m rows padded to padded_rows(m) (bounds its kernel cache)."""
    if padded_rows(m) == m:  # the common case (decode of <= 32 rows): no copy
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [None], "")
    out = torch.ops.mkldnn._linear_pointwise(_padded(x, m), w, bias, "none", [None], "")
    return out[:m].reshape(*x.shape[:-1], out.shape[-1])


def _padded(x: torch.Tensor, m: int) -> torch.Tensor:
    """x as its m rows [m, K], with zero rows added up to padded_rows(m)."""
    return F.pad(x.reshape(m, x.shape[-1]), (0, 0, 0, padded_rows(m) - m))


_scratches = threading.local()


def _scratch(n: int, k: int) -> torch.Tensor:
    """A [n, k] fp32 buffer reused by this thread's int8 and bf16 prefill products: a fresh 7 MB tensor per matrix is a
    fresh mmap, and its page faults cost as much as the product on one core."""
    buf = getattr(_scratches, "buf", None)
    if buf is None or buf.numel() < n * k:
        buf = _scratches.buf = torch.empty(n * k)
    return buf[: n * k].view(n, k)


class Int8Linear(_Gemv):
    """y ~= x @ W.T (+ b) with W held as int8 with one fp32 scale per 32 weights (llama.cpp's Q8_0 block), on the
    gemv kernel at every row count (INT8_GEMV_ROWS), weight-only: the activations stay near fp32 (int16 per
    32-block, ~1e-5), so a row's result does not depend on the other rows. Measured on SmolLM2: a teacher-forced
    KL of 0.0013 from fp32 (99% argmax agreement), bench/RESULTS.md. There is no torch path: fbgemm's dynamic int8
    (7-bit activations per call) cost a KL of 0.24, and torch's weight-only products (`_weight_int8pack_mm`,
    dequantizing per call) ran slower than fp32, so `quantization: int8` without the kernel is a ConfigError at
    engine start (model.check_quantization) rather than another model's numbers or a slow speed mode.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, gemv: GemvKernel | None = None,
                 arena: WeightArena | None = None):
        """arena: where the kernel's int8 values and scales live (2 MB pages: a batch-1 step 1.02x), for good - a
        weight update quantizes into the same place."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError("int8 weights need a float32 model on CPU")
        self.out_features, self.in_features = weight.shape
        if gemv is None or self.in_features % Q8_BLOCK or self.out_features % Q8_ROWS:
            raise ValueError(f"int8 weights need the gemv kernel and a matrix of rows of {Q8_BLOCK}s in groups of "
                             f"{Q8_ROWS} rows, not [{self.out_features}, {self.in_features}]")
        self._arena = arena
        self.dtype, self.device = weight.dtype, weight.device
        self.weight = None  # only the int8 matrix is kept
        self.gemv, self.gemv_rows = gemv, INT8_GEMV_ROWS
        self.q = self.scale = None
        self._quantize(weight, bias)

    def _quantize(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.bias = bias  # added apart: a weight update writes into it in place (model.load_hf_weight)
        q, scale = kernel_quantize(weight)
        if self.q is not None:  # an update: into the same tensors (the kernel's addresses stay valid)
            self.q.copy_(q)
            self.scale.copy_(scale)
        elif self._arena is not None:
            self.q, self.scale = self._arena.take(q), self._arena.take(scale)
        else:
            self.q, self.scale = q, scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, res=residual)

    def _gemv_weight(self) -> torch.Tensor:
        return self.q

    def _gemv_scale(self) -> torch.Tensor | None:
        return self.scale

    def dense(self) -> torch.Tensor:
        """The dequantized weight [out, in]."""
        return dequantize(self.q, self.scale)

    def set_rows(self, lo: int, hi: int, value: torch.Tensor) -> None:
        """A weight update: dequantize, overwrite rows lo:hi, quantize again (the other rows get their int8 values
        back: a dequantized block quantizes to itself)."""
        self.set_row_blocks([(lo, hi, value)])

    def set_row_blocks(self, blocks: list[tuple[int, int, torch.Tensor]]) -> None:
        """Every block of one update in one dequantize / quantize (a fused q|k|v or gate|up: once, not 3 times)."""
        weight = self.dense()
        for lo, hi, value in blocks:
            weight[lo:hi].copy_(value)
        self._quantize(weight, self.bias)

    @property
    def nbytes(self) -> int:
        n = self.q.numel() + self.scale.numel() * 4  # int8 values + an fp32 scale per 32
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)


class Bf16Linear(_Gemv):
    """y = x @ W.T (+ b) with W held in bfloat16 and x, the sums and y in fp32: `quantization: bf16`, weight-only.

    Half fp32's bytes for a decode step to stream, and the weights' rounding is the only change (a bf16 widens to
    fp32 exactly). Not `dtype: bfloat16`, which rounds every activation as HF's bf16 model does (its parity mode)
    and which torch runs at under half this machine's bandwidth (bench/RESULTS.md). Up to GEMV_ROWS rows on the
    kernel (8 weights widened in registers per load); more rows, or no kernel, multiply by the weight widened
    into this thread's reused fp32 buffer (oneDNN beside the kernel, F.linear without it).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, gemv: GemvKernel | None = None):
        if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
            raise ValueError("Bf16Linear holds a bfloat16 weight on CPU")
        self.out_features, self.in_features = weight.shape
        self.dtype, self.device = torch.float32, weight.device  # what it takes and gives
        self.weight = None  # no fp32 copy
        self.w16, self.bias, self.gemv, self.gemv_rows = weight, bias, gemv, GEMV_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.numel() // x.shape[-1]
        if self.fuses(m):
            return self._kernel(x)
        w = _scratch(self.out_features, self.in_features).copy_(self.w16)
        return _onednn_product(x, m, w, self.bias) if self.gemv is not None else F.linear(x, w, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        m = x.numel() // x.shape[-1]
        return self._kernel(x, res=residual) if self.fuses(m) else residual + self(x)

    def _gemv_weight(self) -> torch.Tensor:
        return self.w16

    def dense(self) -> torch.Tensor:
        """The weight [out, in] widened to fp32 (a fresh tensor)."""
        return self.w16.float()

    def set_rows(self, lo: int, hi: int, value: torch.Tensor) -> None:
        """Overwrite rows lo:hi of W, rounded to bf16, in place (the kernel's addresses stay valid)."""
        self.w16[lo:hi].copy_(value)

    @property
    def nbytes(self) -> int:
        return self.w16.numel() * 2 + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)
