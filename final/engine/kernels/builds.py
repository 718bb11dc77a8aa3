"""Building gemv.c: one gcc build per instruction set, cached in $FINAL_CACHE/kernels under a key of the sources,
the generated interface header (abi.py), the flags and the compiler.

Several processes (a server's replicas, Ray actors, other checkouts' test runs) share the cache: a build holds an
fcntl lock on its key (final.models.locked), so one process compiles and the others wait and load its result;
the result lands under its final name atomically (os.replace). A build never deletes another key's library
(another checkout may be about to load it). A cached library that cannot be loaded or checked is built again once
(`build(isa, fresh=True)`, kernels.load).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from final.engine.kernels import abi
from final.models import cache_dir, locked

SOURCE = Path(__file__).with_name("gemv.c")
# what SOURCE includes (in the cache key too)
HEADERS = [Path(__file__).with_name(n) for n in ("products.h", "team.h", "avx512.h", "attention.h", "prefill.h")]
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


class KernelError(RuntimeError):
    """The kernel could not be built, loaded or trusted on this machine (`gemv_kernel()` is then None, and
    `unavailable()` says why)."""


def compiler() -> str:
    cc = os.environ.get("CC") or "gcc"
    found = shutil.which(cc) or (shutil.which("cc") if "CC" not in os.environ else None)
    if not found:
        raise KernelError(f"no C compiler: {cc!r} is not on PATH"
                          + (" (the CC variable)" if "CC" in os.environ else ""))
    return found


def flags(isa: str) -> list[str]:
    """gcc's flags for `isa`'s build, and FINAL_GEMV_CFLAGS' (e.g. -DFINAL_PHASES for bench/profile_decode.py
    --phases), which are in the cache key too."""
    return FLAGS + ISAS[isa][0] + os.environ.get("FINAL_GEMV_CFLAGS", "").split()


def library_path(cc: str, isa: str = "avx2") -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    text = b"".join(p.read_bytes() for p in (SOURCE, *HEADERS)) + abi.header().encode()
    key = hashlib.sha256(text + " ".join(flags(isa)).encode() + version.encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"gemv-{isa}-{key}.so"


def build(isa: str = "avx2", fresh: bool = False) -> Path:
    """The shared library for this source, instruction set and compiler: the cached one, else compiled under the
    key's lock. fresh: compile again even if one is cached (it could not be loaded or checked)."""
    cc = compiler()
    out = library_path(cc, isa)
    if out.exists() and not fresh:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with locked(f"kernel-{out.stem}"):
        if out.exists() and not fresh:  # another process built it while this one waited
            return out
        with tempfile.TemporaryDirectory(prefix=f".{out.stem}-", dir=out.parent) as tmp:
            Path(tmp, "final_abi.h").write_text(abi.header())
            lib = Path(tmp, out.name)
            done = subprocess.run([cc, *flags(isa), f"-I{tmp}", "-o", str(lib), str(SOURCE), "-lm"],
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise KernelError(f"{cc} could not build {SOURCE.name} for {isa}: {done.stderr.strip()[-2000:]}")
            os.replace(lib, out)  # atomic: a process loading the old file keeps its map
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
