"""The engine's own CPU kernel (gemv.c: decode at memory bandwidth), loaded and called here.

gemv.c's entry points: `final_gemv`, one small-M product (fp32, bf16 or int8 weights, with a fused RMSNorm or
SwiGLU before and bias/residual after); `final_decode_step`, a whole decode step (embedding to logits) in one call,
each row after its prefix segments (a cartridge, the prefix cache's nodes); `final_attend`, that step's attention
alone for the torch forward's rows; `final_prefix_attend`, a prefill's attention over one prefix segment
(prefill.h). products.h holds the products' row loops. abi.py defines their parameters and tables once (gemv.c is compiled
against the header it generates, and a library of another interface is refused at load); builds.py compiles it
with the system gcc into $FINAL_CACHE/kernels under a key of the sources, flags and compiler, locked between
processes; scripts/install.sh builds it ahead (`python -m final.engine.kernels`) so a first engine does not wait.
Loaded through ctypes (no torch headers, no ninja), then checked against torch (check.py: products at 1 and 3
rows, decode steps of a random model) before first use; a cached library that fails to load or check is built
again once. The C side checks sizes and allocations (ValueError, IndexError, MemoryError here, nothing run).
Anything unusual (no gcc, a failed build, a CPU without AVX2/FMA, a wrong answer, FINAL_GEMV=0) leaves
`gemv_kernel()` None with the reason logged once (`unavailable()`): fp32 and bf16 then use torch's kernels
(final/engine/linear.py), and int8, which runs on this kernel only, is a ConfigError at engine start.

One build per instruction set (ISAS): the AVX2 loops everywhere, and where the CPU has AVX-512 (avx512.h) 512-bit
int8 loops and, with AVX512-BF16, bf16 dot products. The best ISA the CPU lists is built and checked first; one
that fails to build, load or check falls back to the next. FINAL_GEMV_ISA=<name> asks for one build only (tests
and benchmarks compare them on one machine).
"""

from __future__ import annotations

import _ctypes
import ctypes
import logging
import os
import threading
from array import array
from pathlib import Path

import torch

from final.engine.kernels import abi
from final.engine.kernels.builds import ISAS, KernelError, build, candidate_isas, cpu_flags  # noqa: F401

logger = logging.getLogger(__name__)

Q8_BLOCK = 32  # int8 weights one kernel scale covers (products.h); K must be a multiple
Q8_ROWS = 16  # int8 output rows the kernel stores side by side (products.h q8_group); N must be a multiple
KINDS = {torch.float32: abi.KINDS["W_F32"], torch.int8: abi.KINDS["W_Q8"], torch.bfloat16: abi.KINDS["W_BF16"]}
PREP_NONE, PREP_NORM, PREP_GLU = (abi.PREPS[k] for k in ("PREP_NONE", "PREP_NORM", "PREP_GLU"))


def _status(code: int, what: str) -> None:
    """A C entry point's status as a typed error: MemoryError (an allocation failed), ValueError (sizes the kernel
    refuses); nothing ran in either case."""
    if code == abi.STATUS["FINAL_ENOMEM"]:
        raise MemoryError(f"the engine's kernel could not allocate its buffers for {what}")
    if code == abi.STATUS["FINAL_ESHAPE"]:
        raise ValueError(f"the engine's kernel refuses the sizes of {what}")


class GemvKernel:
    """y = [res +] [bias +] prep(x) @ w.T for contiguous fp32 CPU tensors (see gemv.c for `prep`)."""

    def __init__(self, path: Path, isa: str = "avx2"):
        lib = ctypes.CDLL(str(path))  # ctypes releases the GIL for the call
        try:
            lib.final_abi_text.restype = ctypes.c_char_p
            built = lib.final_abi_text().decode()
            if built != abi.text():
                raise KernelError(f"{path} was built for another interface ({built[:60]}...), not abi.py's")
            if not lib.final_gemv_cpu_ok():
                raise KernelError(f"this CPU lacks what the {isa} build needs ({', '.join(sorted(ISAS[isa][1]))})")
            fns = {name: abi.bind(lib, name) for name in abi.FUNCTIONS}
        except AttributeError as exc:  # a library without the kernel's entry points
            self._close(lib)
            raise KernelError(f"{path} is not a build of gemv.c ({exc})") from exc
        except KernelError:
            self._close(lib)
            raise
        self._lib, self.isa, self.path = lib, isa, path
        self._fn, self._step = fns["final_gemv"], fns["final_decode_step"]
        self._step_floats, self._phases = fns["final_decode_step_floats"], fns["final_phase_cycles"]
        self._team_check = fns["final_team_check"]
        self._attend = fns["final_attend"]
        self._prefix_attend = fns["final_prefix_attend"]

    @staticmethod
    def _close(lib: ctypes.CDLL) -> None:
        """Unload a library that failed its checks, so a rebuilt file at the same path loads anew (dlopen would
        hand back the loaded one by name)."""
        _ctypes.dlclose(lib._handle)

    def close(self) -> None:
        """Unload (kernels.load after a failed self-check; no call may run or follow)."""
        self._close(self._lib)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 res: torch.Tensor | None = None, prep: int = PREP_NONE, norm: torch.Tensor | None = None,
                 eps: float = 0.0, scale: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] ([M, 2K] for PREP_GLU), w [N, K] fp32, bf16, or int8 with scale [N, K / Q8_BLOCK] fp32
        (quantize()'s order; N a multiple of Q8_ROWS) -> [M, N]; every tensor contiguous on CPU, the others fp32."""
        m = x.shape[0]
        n, k = w.shape
        y = torch.empty(m, n, dtype=torch.float32)
        scratch = torch.empty(m, k, dtype=torch.float32) if prep != PREP_NONE else None
        _status(self._fn(*abi.args("final_gemv", x=x.data_ptr(), M=m, K=k, w=w.data_ptr(), kind=KINDS[w.dtype],
                                   scale=address(scale), N=n, bias=address(bias), res=address(res), prep=prep,
                                   g=address(norm), eps=eps, scratch=address(scratch), y=y.data_ptr())),
                f"a [{m}, {k}] x [{n}, {k}] {w.dtype} product")
        return y

    def step_floats(self, m: int, hidden: int, inter: int, heads: int, kv_heads: int, dim: int) -> int:
        """The floats decode_step's work buffer needs for m rows."""
        return self._step_floats(m, hidden, inter, heads, kv_heads, dim)

    def decode_step(self, step: array, embed: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                    kind: torch.dtype, weights: torch.Tensor, caches: torch.Tensor, cache_shape: tuple[int, int, int],
                    heads: int, inter: int, scale: float, eps: float, head: torch.Tensor, logits: torch.Tensor,
                    buffers: tuple[torch.Tensor, torch.Tensor],
                    prefixes: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """One decode step (one new token per row) into logits [M, V]: the embedding rows, every decoder layer
        (RMSNorm, q|k|v, RoPE, the K/V cache write at the row's length, attention over its length + 1 tokens, o +
        residual, RMSNorm, gate|up, SwiGLU, down + residual), the final norm and the lm_head. step: int64 array
        [3 M]: token ids, positions, cached lengths. embed [vocab, hidden]; cos/sin_signed [positions, D] (the
        rope tables). kind: the matrices' dtype (fp32, bf16 or int8, one for all, the lm_head's too). weights [L,
        len(abi.LAYER_FIELDS)] int64 (the matrices' addresses, their int8 scales and biases or 0, the two norms),
        caches [L, 2] the K and V cache addresses, each [rows, Hkv, T, D] = [rows, *cache_shape]; head
        [len(abi.HEAD_FIELDS)] int64: the lm_head's weight, its int8 scales or 0, the final norm. buffers: x [M,
        hidden] and
        work [step_floats(...)] floats. prefixes: the rows' prefix segments (a cartridge, the prefix cache's
        nodes; `segments()`: [M, S, L, 2] int64 K/V addresses of [Hkv, p, D] fp32 tensors, [M, S] int64 p, 0 for
        none), attended before each row's own tokens in one softmax. Contiguous fp32. Nothing runs on an
        IndexError (a token id or position past the tables, a cached length with no slot left in T), ValueError
        (sizes no model has: H not a multiple of Hkv, a work buffer too small) or MemoryError (the kernel's
        buffers)."""
        m = len(step) // 3
        vocab, hidden = embed.shape
        layers, _ = caches.shape
        kv_heads, tokens, dim = cache_shape
        x, work = buffers
        ptab, plens, nseg = segments(prefixes)
        code = self._step(*abi.args(
            "final_decode_step", rows=step.buffer_info()[0], M=m, embed=embed.data_ptr(), vocab=vocab,
            cos=cos.data_ptr(), sin=sin_signed.data_ptr(), span=cos.shape[0], hidden=hidden, inter=inter, H=heads,
            Hkv=kv_heads, D=dim, layers=layers, kind=KINDS[kind], wtab=weights.data_ptr(), ctab=caches.data_ptr(),
            ptab=address(ptab), plens=address(plens), nseg=nseg, T=tokens, scale=scale, eps=eps, head=head.data_ptr(),
            V=logits.shape[1], x=x.data_ptr(), logits=logits.data_ptr(), work=work.data_ptr(),
            work_floats=work.numel()))
        if code > 0:
            row = code - 1
            raise IndexError(f"decode row {row}: token id {step[row]} (vocabulary {vocab}), position "
                             f"{step[m + row]} (rope tables {cos.shape[0]}), cached length {step[2 * m + row]} "
                             f"(cache {tokens} tokens) or prefix length out of range")
        _status(code, f"a decode step of {m} rows ({heads} heads, {kv_heads} KV heads, head size {dim})")

    def attend(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, lengths: torch.Tensor,
               prefixes: tuple[torch.Tensor, torch.Tensor] | None, layer: int, scale: float) -> torch.Tensor:
        """Decode attention of one layer for the torch forward's rows: q [M, H, D] post-RoPE, kc/vc the layer's
        cache [rows, Hkv, T, D] with each row's new K/V already at lengths[b] (int64 [M]), prefixes as decode_step's
        (this layer's of its L) -> [M, H D], attend_head's arithmetic (the whole-step call's). Contiguous fp32."""
        m, heads, dim = q.shape
        _, kv_heads, tokens, _ = kc.shape
        ptab, plens, nseg = segments(prefixes)
        out = torch.empty(m, heads * dim)
        _status(self._attend(*abi.args(
            "final_attend", q=q.data_ptr(), M=m, H=heads, Hkv=kv_heads, D=dim, kc=kc.data_ptr(), vc=vc.data_ptr(),
            T=tokens, lengths=lengths.data_ptr(), ptab=address(ptab), plens=address(plens), nseg=nseg,
            layers=ptab.shape[2] if ptab is not None else layer + 1, l=layer, scale=scale, out=out.data_ptr())),
                f"decode attention of {m} rows ({heads} heads, {kv_heads} KV heads, head size {dim})")
        return out

    def prefix_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill's queries against one prefix segment: q [Hkv, M, D] (contiguous), k/v [Hkv, n, D] (each
        head's rows contiguous, heads any stride apart: a cartridge, a cached prefix, a view into a row's slot)
        -> o [Hkv, M, D] and its log-sum-exp [Hkv, M], fp32 (prefill.h)."""
        kv_heads, m, dim = q.shape
        n = k.shape[1]
        if k.stride() != v.stride() or k.stride()[1:] != (dim, 1):
            raise ValueError(f"prefix K/V of strides {k.stride()} / {v.stride()}: each head's rows must be contiguous")
        o, lse = torch.empty(kv_heads, m, dim), torch.empty(kv_heads, m)
        _status(self._prefix_attend(*abi.args(
            "final_prefix_attend", q=q.data_ptr(), Hkv=kv_heads, M=m, D=dim, k=k.data_ptr(), v=v.data_ptr(), n=n,
            hs=k.stride(0), scale=scale, o=o.data_ptr(), lse=lse.data_ptr())),
                f"prefill attention of {m} queries over {n} prefix tokens ({kv_heads} KV heads, head size {dim})")
        return o, lse

    def team_check(self, late_us: int) -> int:
        """How many times the team's waiting threads slept in the kernel while one thread arrived late_us late at
        the barrier (team.h: spin, yield, then sleep); 0 with one thread."""
        sleeps = self._team_check(late_us)
        _status(sleeps, "the team check")
        return sleeps

    def phase_cycles(self) -> torch.Tensor | None:
        """A -DFINAL_PHASES build's TSC cycles since the last call, [threads, 2 (in the phase, of it waiting in a
        barrier), phases of a decode layer] (gemv.c PHASE), then zeroed; None from a build without them."""
        out = torch.zeros(64 * 2 * 16, dtype=torch.int64)  # products.h PHASE_THREADS, and room for its PHASES
        n = self._phases(out.data_ptr())
        return out[:64 * 2 * n].view(64, 2, n) if n else None

    def self_check(self) -> None:
        """KernelError unless its products and decode steps match torch (check.py)."""
        check.self_check(self)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] (K a multiple of Q8_BLOCK, N of Q8_ROWS) -> the kernel's int8 [N, K] and one fp32 scale per block
    [N, K/32]: symmetric, each block's largest magnitude at 127 (llama.cpp's Q8_0, with an fp32 scale). Both are
    stored in the kernel's interleaved order (products.h q8_group: 16 rows side by side, k in pairs), so read
    them through dequantize(), not by row."""
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // Q8_BLOCK, Q8_BLOCK)
    scale = (blocks.abs().amax(dim=-1) / 127).clamp_min(1e-12)
    q = torch.round(blocks / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    g = n // Q8_ROWS
    q = q.view(g, Q8_ROWS, k // 2, 2).permute(0, 2, 1, 3).contiguous().view(n, k)  # [N/16][K/2][16][2]
    # [N/16][K/32][16]
    scale = scale.view(g, Q8_ROWS, k // Q8_BLOCK).permute(0, 2, 1).contiguous().view(n, k // Q8_BLOCK)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 weight [N, K], row-major, the kernel multiplies by: q's blocks times their scales (into `out` if
    given), undoing quantize()'s interleaving."""
    n, k = q.shape
    g = n // Q8_ROWS
    out = torch.empty(n, k) if out is None else out
    out.view(g, Q8_ROWS, k // 2, 2).copy_(q.view(g, k // 2, Q8_ROWS, 2).permute(0, 2, 1, 3))
    rows = scale.view(g, k // Q8_BLOCK, Q8_ROWS).permute(0, 2, 1)  # [N/16, 16, K/32]
    out.view(g, Q8_ROWS, k // Q8_BLOCK, Q8_BLOCK).mul_(rows[..., None])
    return out


def segments(prefixes: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                                         int]:
    """(ptab [M, S, L, 2], plens [M, S], S) for the kernel from a rows' prefix table; one segment a row may also
    come as [M, L, 2] and [M] (a cartridge each). (None, None, 0) for none."""
    if prefixes is None:
        return None, None, 0
    ptab, plens = prefixes
    if plens.dim() == 1:
        ptab, plens = ptab[:, None], plens[:, None]
    return ptab.contiguous(), plens.contiguous(), plens.shape[1]


def address(t: torch.Tensor | None) -> int:
    """A tensor's data address for the C side (0, its NULL, for None)."""
    return t.data_ptr() if t is not None else 0


_lock = threading.Lock()
_loaded: list[GemvKernel | None] = []  # [] until the first call, then [kernel or None]
_why: list[str] = []  # why _loaded holds None


def gemv_kernel() -> GemvKernel | None:
    """The checked kernel, or None (FINAL_GEMV=0, or it cannot run here: logged once, `unavailable()` says why)."""
    if os.environ.get("FINAL_GEMV", "1") == "0":
        return None
    with _lock:
        if not _loaded:
            kernel, why = _load()
            _loaded.append(kernel)
            _why[:] = [why]
        return _loaded[0]


def unavailable() -> str | None:
    """Why gemv_kernel() is None (FINAL_GEMV=0, no gcc, no AVX2, a build that failed or disagreed with torch),
    or None where the kernel runs."""
    if gemv_kernel() is not None:
        return None
    if os.environ.get("FINAL_GEMV", "1") == "0":
        return "FINAL_GEMV=0 turns the engine's kernel off"
    return _why[0] if _why and _loaded and _loaded[0] is None else "the engine's kernel is not loaded"


def _load() -> tuple[GemvKernel | None, str]:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        why = f"the engine's kernel needs AVX2/FMA (torch reports {torch.backends.cpu.get_cpu_capability()})"
        logger.info("%s; using torch's kernels", why)
        return None, why
    failures = []
    try:
        for isa in candidate_isas():
            try:
                kernel = load(isa)
            except (KernelError, OSError) as exc:
                failures.append(f"{isa}: {exc}")
                continue
            if failures:
                logger.info("the engine's GEMV kernel runs the %s build (%s)", isa, "; ".join(failures))
            return kernel, ""
    except KernelError as exc:  # a FINAL_GEMV_ISA that names no build
        failures.append(str(exc))
    why = "; ".join(failures) or "this CPU lists neither AVX2 nor FMA"
    logger.warning("the engine's GEMV kernel is unavailable (%s); using torch's kernels", why)
    return None, why


def use(isa: str) -> GemvKernel:
    """Load `isa`'s build and make it the kernel of engines made after this call (bench/profile_decode.py --isas
    compares builds side by side in one process)."""
    kernel = load(isa)
    with _lock:
        _loaded[:] = [kernel]
    return kernel


def load(isa: str) -> GemvKernel:
    """The build for `isa`, compiled if needed, loaded and checked against torch (KernelError if any step fails).
    A cached library that does not load or check (a truncated file, another interface, a wrong answer) is built
    again once; one that fails again, or a CPU without the build's instructions, is the error."""
    path = build(isa)
    try:
        return _checked(path, isa)
    except (KernelError, OSError) as exc:
        if "this CPU lacks" in str(exc):
            raise
        logger.warning("the cached kernel %s failed (%s); building it again", path.name, exc)
    return _checked(build(isa, fresh=True), isa)


def _checked(path: Path, isa: str) -> GemvKernel:
    kernel = GemvKernel(path, isa)
    try:
        kernel.self_check()
    except KernelError:
        kernel.close()
        raise
    return kernel


# at the end: check.py imports this module's names (quantize, address, ...), defined above
from final.engine.kernels import check  # noqa: E402
