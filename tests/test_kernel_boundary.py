"""The C kernel's boundary: one interface definition checked at load, sizes and allocations checked in C (typed
Python errors, never a crash), the build cache shared between processes (a lock, a bad library built again once,
other builds left alone), the -D knobs' guards, and the team barrier sleeping after its bounded spin."""

from __future__ import annotations

import re
import subprocess
import threading
import time

import pytest
import torch

from final.engine import kernels
from final.engine.kernels import abi, builds, check
from final.engine.kernels.builds import KernelError

KERNEL = kernels.gemv_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the engine's kernel does not run here (no gcc or AVX2)")
# a build whose flags the CPU has whatever it lists beyond AVX2 (CI machines may lack AVX-512)
ISA = "avx2"


def test_the_interface_is_written_once_in_abi_py():
    """gemv.c (or a header it includes) defines each entry point with abi.py's generated parameter list and reads
    the tables by abi.py's field names; no file holds a second copy of the version, a ctypes argument list or the
    field order."""
    source = "".join(p.read_text() for p in (builds.SOURCE, *builds.HEADERS))
    for name in abi.FUNCTIONS:
        assert re.search(rf"\b{name}\({name.upper()}_PARAMS\)", source), name
    header = abi.header()
    assert f"#define FINAL_ABI {abi.VERSION}" in header and abi.text() in header
    assert "W_FIELDS = 14" in header and "B_O = 9" in header  # the layer table, o_proj's bias included
    wrapper = (builds.SOURCE.parent / "__init__.py").read_text()
    assert "argtypes" not in wrapper and "ABI =" not in wrapper and "return 12" not in source
    with pytest.raises(TypeError, match="missing"):
        abi.args("final_decode_step_floats", M=1)


def _cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FINAL_CACHE", str(tmp_path))
    monkeypatch.delenv("FINAL_GEMV_CFLAGS", raising=False)
    return builds.library_path(builds.compiler(), ISA)


@needs_kernel
def test_a_corrupt_or_foreign_cached_library_is_built_again_once(monkeypatch, tmp_path):
    path = _cache(monkeypatch, tmp_path)
    path.parent.mkdir(parents=True)
    other = path.with_name(f"gemv-{ISA}-0123456789abcdef.so")  # another checkout's build
    other.write_bytes(b"another key")
    path.write_bytes(b"\x7fELF truncated by a crash")
    kernel = kernels.load(ISA)  # dlopen fails, so it is built again and checked
    assert kernel.path == path and path.read_bytes()[:4] == b"\x7fELF" and path.stat().st_size > 10_000
    assert other.read_bytes() == b"another key"  # a build leaves other keys alone
    # a library of another interface (an older gemv.c under this key): refused at load, built again
    kernel.close()  # (a process loads a path once: dlopen would hand back the loaded library by name)
    stub = tmp_path / "stub.c"
    stub.write_text('const char *final_abi_text(void) { return "abi 1; int final_gemv(void)"; }\n')
    subprocess.run([builds.compiler(), "-shared", "-fPIC", "-o", str(path), str(stub)], check=True)
    with pytest.raises(KernelError, match="another interface"):
        kernels.GemvKernel(path, ISA)
    assert kernels.load(ISA).path == path and "final_decode_step" in path.read_bytes().decode("latin-1")


@needs_kernel
def test_a_library_that_fails_its_check_twice_is_an_error_not_a_loop(monkeypatch):
    calls = []

    def build(isa="avx2", fresh=False):  # the loaded kernel's library stands in for a build (no compile here)
        calls.append(fresh)
        return KERNEL.path

    def wrong(_kernel):
        raise KernelError("case 0 differs from torch by 3 (a stand-in)")

    monkeypatch.setattr(kernels, "build", build)
    monkeypatch.setattr(kernels.GemvKernel, "self_check", wrong)
    with pytest.raises(KernelError, match="stand-in"):
        kernels.load(KERNEL.isa)
    assert calls == [False, True]


def test_a_build_waits_for_another_process_building_the_same_key(monkeypatch, tmp_path):
    """The key's fcntl lock: a process that finds the build under way waits, then loads what the other built
    instead of compiling it again (the stand-in 'other process' holds the lock and writes the library)."""
    from final.models import locked

    path = _cache(monkeypatch, tmp_path)
    compiles = []
    real_run = builds.subprocess.run

    def run(cmd, *a, **kw):
        if "-o" in cmd:
            compiles.append(cmd)
        return real_run(cmd, *a, **kw)

    monkeypatch.setattr(builds.subprocess, "run", run)
    got = []
    with locked(f"kernel-{path.stem}"):
        waiter = threading.Thread(target=lambda: got.append(builds.build(ISA)))
        waiter.start()
        time.sleep(0.5)  # the waiter is blocked on the lock (or not started yet: either way it must not compile)
        assert waiter.is_alive() and not got
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"built by the other process")
    waiter.join(timeout=60)
    assert got == [path] and not compiles


@pytest.mark.parametrize("knob,text", [("-DWIDE=9", "WIDE"), ("-DCHUNK_ROWS=24", "CHUNK_ROWS"),
                                       ("-DSPIN_YIELDS=-1", "SPIN_YIELDS")])
def test_a_knob_out_of_range_does_not_build(monkeypatch, tmp_path, knob, text):
    _cache(monkeypatch, tmp_path)
    try:
        builds.compiler()
    except KernelError:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("FINAL_GEMV_CFLAGS", knob)
    with pytest.raises(KernelError, match=rf"#error.*{text}"):
        builds.build(ISA)


@needs_kernel
def test_sizes_the_kernel_cannot_take_are_typed_errors_and_it_decodes_on():
    g = torch.Generator().manual_seed(5)
    case = check.decode_case(g, torch.float32, [3, 15], [0, 0], T=16)
    case.lengths = [3, 16]  # no slot left in row 1's cache: its new token would be written past the end
    with pytest.raises(IndexError, match="decode row 1: .*cached length 16 .*cache 16 tokens"):
        check.run_step(KERNEL, case)
    case.lengths, case.H = [3, 15], 3  # 3 heads on 2 KV heads
    with pytest.raises(ValueError, match="refuses the sizes of a decode step"):
        check.run_step(KERNEL, case)
    case.H, case.plens = 4, [0, 2**62]  # a prefix longer than memory: the attention scratch cannot be allocated
    with pytest.raises(MemoryError, match="could not allocate"):
        check.run_step(KERNEL, case)
    case.plens = [0, 0]
    assert check.step_error(KERNEL, case) < check.STEP_TOL  # and the next step is right
    # a product of more rows than memory (an over-long int8 prompt): MemoryError, nothing read
    q, scale = kernels.quantize(torch.randn(16, 64, generator=g))
    x, y = torch.randn(1, 64), torch.empty(1, 16)
    big = 2**31 - 1
    code = KERNEL._fn(*abi.args("final_gemv", x=x.data_ptr(), M=big, K=big // 32 * 32, w=q.data_ptr(),
                                kind=abi.KINDS["W_Q8"], scale=scale.data_ptr(), N=16, bias=0, res=0, prep=0, g=0,
                                eps=0.0, scratch=0, y=y.data_ptr()))
    assert code == abi.STATUS["FINAL_ENOMEM"]
    with pytest.raises(ValueError, match="refuses the sizes"):  # int8 rows that are no whole groups of 16
        KERNEL(torch.randn(2, 64), torch.zeros(8, 64, dtype=torch.int8), scale=torch.ones(8, 2))


@needs_kernel
def test_the_team_barrier_sleeps_after_a_bounded_spin():
    """A thread that arrives 200 ms late: the others spin ~1 ms, yield, then sleep in the kernel (woken when it
    arrives) instead of spinning out its lateness; one thread alone never waits."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert KERNEL.team_check(200_000) >= 1
        torch.set_num_threads(1)
        assert KERNEL.team_check(1000) == 0
    finally:
        torch.set_num_threads(before)
