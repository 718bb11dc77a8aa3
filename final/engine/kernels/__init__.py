"""The engine's own CPU kernel (gemv.c: decode at memory bandwidth), built and loaded here.

gemv.c has two entry points: `final_gemv`, one small-M product (fp32, bf16 or int8 weights, with a fused RMSNorm
or SwiGLU before and bias/residual after), and `final_decode_step`, a whole decode step (embedding to logits) in one
call; products.h holds their row loops. Built once with the system gcc (the one a fresh machine already has for pip) into $FINAL_CACHE/kernels,
named by a hash of the source, flags and compiler, so an edit or another gcc rebuilds it; scripts/install.sh
builds it ahead (`python -m final.engine.kernels`, __main__.py) so a first engine does not wait. Loaded through
ctypes (no torch headers, no ninja: a 1 s build), checked against torch on random data before first use. Anything unusual (no gcc, a
failed build, a CPU without AVX2/FMA, a wrong answer, FINAL_GEMV=0) leaves `gemv_kernel()` None with the reason
logged once, and the engine uses torch's kernels (final/engine/linear.py) as before.

One build per instruction set (ISAS): the AVX2 loops everywhere, and where the CPU has AVX-512 (avx512.h) 512-bit
int8 loops and, with AVX512-BF16, bf16 dot products. The best ISA the CPU lists is built and checked first; one
that fails to build, load or check falls back to the next. FINAL_GEMV_ISA=<name> asks for one build only (tests
and benchmarks compare them on one machine).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from array import array
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gemv.c")
# what SOURCE includes (in the cache key too)
HEADERS = [Path(__file__).with_name(n) for n in ("products.h", "team.h", "avx512.h", "attention.h")]
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# 512-bit where avx512.h asks for it; gcc's own vectorizing stays 256-bit (its zmm loops made a bf16 batch-1 step
# 4-6% slower on Zen 4, measured against the same build with this flag)
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=256"]
# name -> (extra gcc flags, the /proc/cpuinfo flags it needs), best first; gemv.c's final_gemv_cpu_ok checks the same
# (the bf16 build takes AVX512-VNNI too, for int8's vpdpwssd: every CPU with AVX512-BF16 so far has it)
ISAS = {"avx512bf16": (_AVX512 + ["-mavx512bf16", "-mavx512vnni"],
                       {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}),
        "avx512": (_AVX512, {"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
        "avx2": ([], {"avx2", "fma"})}
ABI = 12  # final_gemv_abi() of the source this wrapper speaks to
Q8_BLOCK = 32  # int8 weights one kernel scale covers (products.h); K must be a multiple
Q8_ROWS = 16  # int8 output rows the kernel stores side by side (products.h q8_group); N must be a multiple
KINDS = {torch.float32: 0, torch.int8: 1, torch.bfloat16: 2}  # products.h's W_F32, W_Q8, W_BF16
PREP_NONE, PREP_NORM, PREP_GLU = 0, 1, 2
_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class KernelError(RuntimeError):
    """The kernel could not be built, loaded or trusted on this machine (the engine falls back, saying why)."""


def _compiler() -> str:
    cc = os.environ.get("CC") or "gcc"
    found = shutil.which(cc) or (shutil.which("cc") if "CC" not in os.environ else None)
    if not found:
        raise KernelError(f"no C compiler: {cc!r} is not on PATH" + (" (the CC variable)" if "CC" in os.environ else ""))
    return found


def flags(isa: str) -> list[str]:
    """gcc's flags for `isa`'s build, and FINAL_GEMV_CFLAGS' (e.g. -DFINAL_PHASES for bench/profile_decode.py
    --phases), which are in the cache key too."""
    return FLAGS + ISAS[isa][0] + os.environ.get("FINAL_GEMV_CFLAGS", "").split()


def library_path(cc: str, isa: str = "avx2") -> Path:
    from final.models import cache_dir

    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    text = b"".join(p.read_bytes() for p in (SOURCE, *HEADERS))
    key = hashlib.sha256(text + " ".join(flags(isa)).encode() + version.encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"gemv-{isa}-{key}.so"


def build(isa: str = "avx2") -> Path:
    """The shared library for this source, instruction set and compiler, compiled if not cached yet."""
    cc = _compiler()
    out = library_path(cc, isa)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    done = subprocess.run([cc, *flags(isa), "-o", str(tmp), str(SOURCE), "-lm"], capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise KernelError(f"{cc} could not build {SOURCE.name} for {isa}: {done.stderr.strip()[-2000:]}")
    os.replace(tmp, out)  # atomic: a concurrent build of the same key writes the same bytes
    for old in out.parent.glob(f"gemv-{isa}-*.so"):  # earlier sources' builds (a loaded one keeps its map)
        if old != out:
            old.unlink(missing_ok=True)
    for old in out.parent.glob("gemv-????????????????.so"):  # builds from before there was one per ISA
        old.unlink(missing_ok=True)
    return out


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none: then only the library's own
    check decides)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def candidate_isas() -> list[str]:
    """The builds to try, best first: FINAL_GEMV_ISA's alone if set, else every ISA whose flags the CPU lists."""
    forced = os.environ.get("FINAL_GEMV_ISA")
    if forced:
        if forced not in ISAS:
            raise KernelError(f"FINAL_GEMV_ISA={forced!r} is none of {sorted(ISAS)}")
        return [forced]
    have = cpu_flags()
    return [isa for isa, (_, need) in ISAS.items() if not have or need <= have]


class GemvKernel:
    """y = [res +] [bias +] prep(x) @ w.T for contiguous fp32 CPU tensors (see gemv.c for `prep`)."""

    def __init__(self, path: Path, isa: str = "avx2"):
        lib = ctypes.CDLL(str(path))  # ctypes releases the GIL for the call
        if lib.final_gemv_abi() != ABI:
            raise KernelError(f"{path} speaks ABI {lib.final_gemv_abi()}, this wrapper {ABI}")
        if not lib.final_gemv_cpu_ok():
            raise KernelError(f"this CPU lacks what the {isa} build needs ({', '.join(sorted(ISAS[isa][1]))})")
        self.isa = isa
        self._fn = lib.final_gemv
        self._fn.argtypes = [_P, _I, _I, _P, _I, _P, _I, _P, _P, _I, _P, _F, _P, _P]
        self._fn.restype = None
        self._step = lib.final_decode_step
        self._step.argtypes = [_P, _I, _P, ctypes.c_int64, _P, _P, ctypes.c_int64, _I, _I, _I, _I, _I, _I, _I, _P,
                               _P, _P, _P, ctypes.c_int64, _F, _F, _P, _I, _P, _P, _P]
        self._step.restype = _I
        self._step_floats = lib.final_decode_step_floats
        self._step_floats.argtypes = [_I] * 6
        self._step_floats.restype = ctypes.c_int64
        self._phases = lib.final_phase_cycles
        self._phases.argtypes = [_P]
        self.path = path

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 res: torch.Tensor | None = None, prep: int = PREP_NONE, norm: torch.Tensor | None = None,
                 eps: float = 0.0, scale: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] ([M, 2K] for PREP_GLU), w [N, K] fp32, bf16, or int8 with scale [N, K / Q8_BLOCK] fp32
        (quantize()'s order; N a multiple of Q8_ROWS) -> [M, N]; every tensor contiguous on CPU, the others fp32."""
        m = x.shape[0]
        n, k = w.shape
        y = torch.empty(m, n, dtype=torch.float32)
        scratch = torch.empty(m, k, dtype=torch.float32) if prep != PREP_NONE else None
        self._fn(x.data_ptr(), m, k, w.data_ptr(), KINDS[w.dtype], address(scale), n, address(bias), address(res),
                 prep, address(norm), eps, address(scratch), y.data_ptr())
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
        11] int64 (gemv.c's W_* fields: the matrices' addresses, their int8 scales or 0, the qkv bias or 0, the
        two norms), caches [L, 2] the K and V cache addresses, each [rows, Hkv, T, D] = [rows, *cache_shape];
        head [3] int64: the lm_head's weight, its int8 scales or 0, the final norm. buffers: x [M, hidden] and
        work [step_floats(...)] floats. prefixes: the rows' cartridges, ([M, L, 2] int64 K/V addresses of [Hkv,
        p, D] fp32 tensors, [M] int64 p, 0 for a row without), attended before each row's own tokens. Contiguous
        fp32. IndexError for a token id or position past the tables (nothing runs then)."""
        m = len(step) // 3
        vocab, hidden = embed.shape
        layers, _ = caches.shape
        kv_heads, tokens, dim = cache_shape
        x, work = buffers
        ptab, plens = prefixes if prefixes is not None else (None, None)
        bad = self._step(step.buffer_info()[0], m, embed.data_ptr(), vocab, cos.data_ptr(), sin_signed.data_ptr(),
                         cos.shape[0], hidden, inter, heads, kv_heads, dim, layers, KINDS[kind], weights.data_ptr(),
                         caches.data_ptr(), address(ptab), address(plens), tokens, scale, eps, head.data_ptr(),
                         logits.shape[1], x.data_ptr(), logits.data_ptr(), work.data_ptr())
        if bad:
            row = bad - 1
            raise IndexError(f"decode row {row}: token id {step[row]} (vocabulary {vocab}) or position "
                             f"{step[m + row]} (rope tables {cos.shape[0]}) out of range")

    def phase_cycles(self) -> torch.Tensor | None:
        """A -DFINAL_PHASES build's TSC cycles since the last call, [threads, 2 (in the phase, of it waiting in a
        barrier), phases of a decode layer] (gemv.c PHASE), then zeroed; None from a build without them."""
        out = torch.zeros(64 * 2 * 16, dtype=torch.int64)  # products.h PHASE_THREADS, and room for its PHASES
        n = self._phases(out.data_ptr())
        return out[:64 * 2 * n].view(64, 2, n) if n else None

    def self_check(self) -> None:
        """Every prep and epilogue against torch on odd shapes (tails of rows, of K and of the row pairs)."""
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(13, 37, generator=g), torch.randn(3, 74, generator=g)
        bias, res, norm = torch.randn(13, generator=g), torch.randn(3, 13, generator=g), torch.randn(37, generator=g)
        h = F.rms_norm(x[:, :37], (37,), norm, 1e-6)
        tol = 1e-4
        cases = [(self(x[:, :37].contiguous(), w), F.linear(x[:, :37], w), tol),
                 (self(x[:, :37].contiguous(), w, bias, res), res + F.linear(x[:, :37], w, bias), tol),
                 (self(x[:, :37].contiguous(), w, prep=PREP_NORM, norm=norm, eps=1e-6), F.linear(h, w), tol),
                 (self(x, w, res=res, prep=PREP_GLU), res + F.linear(F.silu(x[:, :37]) * x[:, 37:], w), tol)]
        q = torch.randint(-127, 128, (32, 64), dtype=torch.int8, generator=g)  # two groups of Q8_ROWS
        scale = torch.rand(32, 64 // Q8_BLOCK, generator=g) / 100
        bias32, res32 = torch.randn(32, generator=g), torch.randn(3, 32, generator=g)
        want = res32 + F.linear(x[:, :64], dequantize(q, scale), bias32)
        # int8 rounds x to int16 per 32-block: ~1e-5 of the output's scale, as the tests allow
        cases.append((self(x[:, :64].contiguous(), q, bias32, res32, scale=scale), want, tol * want.abs().max().item()))
        wb = w.bfloat16()
        cases.append((self(x[:, :37].contiguous(), wb, bias, res), res + F.linear(x[:, :37], wb.float(), bias), tol))
        for i, (got, want, atol) in enumerate(cases):
            if not torch.allclose(got, want, rtol=tol, atol=atol):
                raise KernelError(f"case {i} differs from torch by {(got - want).abs().max().item():.3g}")


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
    scale = scale.view(g, Q8_ROWS, k // Q8_BLOCK).permute(0, 2, 1).contiguous().view(n, k // Q8_BLOCK)  # [N/16][K/32][16]
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


def address(t: torch.Tensor | None) -> int:
    """A tensor's data address for the C side (0, its NULL, for None)."""
    return t.data_ptr() if t is not None else 0


_lock = threading.Lock()
_loaded: list[GemvKernel | None] = []  # [] until the first call, then [kernel or None]


def gemv_kernel() -> GemvKernel | None:
    """The checked kernel, or None (FINAL_GEMV=0, or it cannot run here: logged once with the reason)."""
    if os.environ.get("FINAL_GEMV", "1") == "0":
        return None
    with _lock:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0]


def _load() -> GemvKernel | None:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        logger.info("the engine's GEMV kernel needs AVX2/FMA (torch reports %s); using torch's kernels",
                    torch.backends.cpu.get_cpu_capability())
        return None
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
            return kernel
    except KernelError as exc:  # a FINAL_GEMV_ISA that names no build
        failures.append(str(exc))
    logger.warning("the engine's GEMV kernel is unavailable (%s); using torch's kernels",
                   "; ".join(failures) or "this CPU lists neither AVX2 nor FMA")
    return None


def use(isa: str) -> GemvKernel:
    """Load `isa`'s build and make it the kernel of engines made after this call (bench/profile_decode.py --isas
    compares builds side by side in one process)."""
    kernel = load(isa)
    with _lock:
        _loaded[:] = [kernel]
    return kernel


def load(isa: str) -> GemvKernel:
    """The build for `isa`, compiled if needed, loaded and checked against torch (KernelError if any step fails)."""
    kernel = GemvKernel(build(isa), isa)
    kernel.self_check()
    return kernel
