"""Timing helpers shared by the benchmarks: side-by-side medians, the machine, and its memory bandwidth.

Ours and the reference always run interleaved in one process (ref, ours, ref, ours, ...) so a noisy neighbour
slows both; each figure is the median of the repeats.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch

T = TypeVar("T")


@dataclass
class Pair:
    """Median seconds of the reference and of ours, from interleaved repeats."""

    reference_s: float
    ours_s: float
    reference_all: list[float]
    ours_all: list[float]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def side_by_side(reference: Callable[[], Any], ours: Callable[[], Any], repeats: int, warmup: int = 1) -> Pair:
    """Run reference and ours alternately (after `warmup` untimed runs of each); medians of `repeats` each."""
    for _ in range(warmup):
        reference()
        ours()
    ref, mine = [], []
    for i in range(repeats):
        # Alternate who goes first so a slow start or a warming cache does not always favour one side.
        order = ((ref, reference), (mine, ours)) if i % 2 == 0 else ((mine, ours), (ref, reference))
        for sink, fn in order:
            sink.append(timed(fn)[0])
    return Pair(statistics.median(ref), statistics.median(mine), ref, mine)


def on_own_thread(fn: Callable[[], T]) -> T:
    """Run fn on a short-lived thread and return its result: the OpenMP team it starts ends with it, so no team
    lingers on the caller's thread (a lingering team makes libgomp throttle every later parallel region)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="final-bench-probe")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def copy_bandwidth(megabytes: int = 512, repeats: int = 10) -> float:
    """Bytes per second of a large tensor copy, counting the read and the write (STREAM's copy convention)."""
    n = megabytes * 2**20
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = min(timed(lambda: dst.copy_(src))[0] for _ in range(repeats))
    return 2 * n / best


def read_rate(repeats: int = 3, big: torch.Tensor | None = None) -> float:
    """The machine's read-only rate in bytes per second: a sum over 128 MB (or `big`, kept by a caller that samples
    often), the best of `repeats`: the roofline's yardstick (a decode step streams its weights once)."""
    big = torch.ones(128 * 2**20 // 4) if big is None else big
    return big.nbytes / min(timed(lambda: big.sum())[0] for _ in range(repeats))


def matmul_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 3, budget_s: float = 0.25) -> float:
    """FLOP/s of one large square matmul: the compute ceiling the decode-step floor is also bounded by.

    The size grows from 256 to `n` only while one matmul stays under `budget_s`: where a dtype has no fast kernel
    (bf16 on a CPU without AVX-512 BF16 runs at ~1 GFLOP/s) a 2048 matmul takes a minute and says nothing a
    smaller one does not - throughput is flat in n once the matrices outgrow the caches."""
    size = min(256, n)
    while True:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        torch.matmul(a, b)  # warm-up: oneDNN primitives, the thread pool (a first call can take longer)
        took = timed(lambda: torch.matmul(a, b))[0]
        if size >= n or took > budget_s:
            break
        size = min(2 * size, n)
    best = min([took] + [timed(lambda: torch.matmul(a, b))[0] for _ in range(repeats - 1)])  # `took` is a timing too
    return 2 * size**3 / best


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The CPU features that decide which kernels run (fp32/bf16/int8 GEMMs here and in llama.cpp)."""
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return [w for w in wanted if w in flags]


def machine(device: str) -> dict:
    """What the numbers were measured on (printed with every run and recorded in bench/RESULTS.md)."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_name(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(), "device": device,
    }
    try:
        info["loadavg_1min"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
