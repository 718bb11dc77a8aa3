"""Weight matrices of the embedded engine, prepacked for the CPU's GEMM where that pays.

On CPU, PyTorch's `F.linear` hands a decode step's small-M products (M = running rows) to MKL's sgemm on a
plain row-major weight, which reaches about 10 GB/s here; oneDNN on a weight reordered once into its blocked
layout reaches 17-19 GB/s (fp32 and bf16 with AMX), measured in bench/RESULTS.md. So on CPU each weight is
reordered at load time and the dense copy is dropped (no second copy of the model). Anything unusual (no
oneDNN, another device, a packed product that disagrees with F.linear) falls back to the dense weight.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_PACK_BATCH = 32  # oneDNN's layout hint; measured flat across M in 1..32 for these shapes
_EXACT_ROWS = 32  # up to here every row count has its own kernel: decode batches, no padding


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


def _cpu_has_bf16() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)  # torch's own probe of the CPU
    return bool(check()) if check is not None else False


class Linear:
    """y = x @ W.T (+ b), W [out, in]. `dense()` gives W back; `set_rows()` updates part of it in place."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = False):
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.dtype, self.device = weight.dtype, weight.device
        self.weight: torch.Tensor | None = weight  # dense, or None when packed
        self.packed: torch.Tensor | None = None
        self._want_pack = pack
        if pack:
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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            m = x.numel() // x.shape[-1]
            if padded_rows(m) == m:  # the common case (decode of <= 32 rows): no copy
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")
            out = torch.ops.mkldnn._linear_pointwise(_padded(x, m), self.packed, self.bias, "none", [None], "")
            return out[:m].reshape(*x.shape[:-1], self.out_features)
        if self._want_pack:  # updated since the last use: reorder once, not once per streamed slice
            self._pack(self.weight)
            return self(x)
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x). In fp32 oneDNN adds in the GEMM's epilogue (one op, bitwise the same result);
        in bf16 the separate add keeps HF's rounding (product rounded to bf16, then added)."""
        if self.packed is not None and self.dtype == torch.float32:
            m = x.numel() // x.shape[-1]
            if padded_rows(m) == m:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")
            out = torch.ops.mkldnn._linear_pointwise.binary(_padded(x, m), _padded(residual, m), self.packed,
                                                            self.bias, "add")
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


def _padded(x: torch.Tensor, m: int) -> torch.Tensor:
    """x as its m rows [m, K], with zero rows added up to padded_rows(m)."""
    return F.pad(x.reshape(m, x.shape[-1]), (0, 0, 0, padded_rows(m) - m))


def int8_available() -> bool:
    """fbgemm's dynamic int8 linear (x86 CPUs with AVX2): what `quantization: int8` runs on."""
    return "fbgemm" in torch.backends.quantized.supported_engines


class Int8Linear:
    """y ~= x @ W.T (+ b) with W held as int8 (one scale per output row) and fbgemm's dynamic int8 GEMM.

    The activations are quantized too, per call (one 7-bit scale over the step's rows, as fbgemm's dynamic
    quantization does; llama.cpp's Q8_0 likewise quantizes activations, per block of 32). So results are not
    fp32's, and a row's can depend on the other rows of its step: this is the opt-in speed mode, its greedy
    agreement with fp32 is measured in bench/RESULTS.md. Measured here first (AVX2, one thread, SmolLM2's
    matrices at M=1): torch's weight-only `_weight_int8pack_mm` takes 4x fp32's time with fp32 activations (no
    vectorized path for them) and 0.6x with bf16 ones but 1.3x at M=8; `_int_mm` 3x; fbgemm 0.3x at M=1 and M=8.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError("int8 weights need a float32 model on CPU")
        self.out_features, self.in_features = weight.shape
        self.dtype, self.device = weight.dtype, weight.device
        self.weight = None  # only the packed int8 matrix is kept
        self._quantize(weight, bias)

    def _quantize(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        scale = (weight.abs().amax(dim=1).double() / 127).clamp_min(1e-12)
        zero = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # torch marks quantized tensor creation deprecated; fbgemm still needs it
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(weight.float(), scale, zero, 0, torch.qint8)
        self.bias = bias  # added apart: a weight update writes into it in place (model.load_hf_weight)
        self.packed = torch.ops.quantized.linear_prepack(q, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic(x, self.packed, True)  # reduce_range: no int16 overflow on AVX2
        return y if self.bias is None else y + self.bias

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return residual + self(x)

    def dense(self) -> torch.Tensor:
        """The dequantized weight [out, in]."""
        return torch.ops.quantized.linear_unpack(self.packed)[0].dequantize()

    def set_rows(self, lo: int, hi: int, value: torch.Tensor) -> None:
        """A weight update: dequantize, overwrite rows lo:hi, quantize again (other rows keep their int8 values)."""
        weight = self.dense()
        weight[lo:hi].copy_(value)
        self._quantize(weight, self.bias)

    @property
    def nbytes(self) -> int:
        n = self.out_features * self.in_features + 8 * self.out_features  # int8 values + a double scale per row
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)
