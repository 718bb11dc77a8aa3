"""One buffer for every weight the gemv kernel streams, on 2 MB pages where Linux gives them.

Batch-1 decode reads every weight once a step, front to back. On 4 KB pages that is a TLB miss every 4 KB, and
the L2 prefetcher stops at each page boundary; in one 2 MB-aligned buffer advised MADV_HUGEPAGE (transparent huge
pages in their default `madvise` mode) the kernel streamed 4-5% more (bench/RESULTS.md: 44.4 -> 46.1 GB/s at
M=1 on the 2-core EPYC). Where the advice is refused (another OS, THP off) the buffer is ordinary memory: only
the speed differs.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

logger = logging.getLogger(__name__)

HUGE = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line
_MADV_HUGEPAGE = 14


class WeightArena:
    """`take(t)` copies t into the next slot of one preallocated buffer and returns the copy (same dtype, shape)."""

    def __init__(self, nbytes: int):
        self._buf = torch.empty(nbytes + HUGE, dtype=torch.uint8)
        base = self._buf.data_ptr()
        self._pos = (-base) % HUGE  # the first 2 MB boundary inside the buffer
        self._end = self._pos + nbytes
        self.huge = _advise_huge(base + self._pos, nbytes)

    @staticmethod
    def size(tensors_bytes: list[int]) -> int:
        """The bytes an arena needs for tensors of these sizes (each rounded up to a cache line)."""
        return sum(-(-n // _ALIGN) * _ALIGN for n in tensors_bytes)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        if self._pos + n > self._end:
            raise ValueError(f"weight arena full: {n} more bytes at {self._pos} of {self._end}")
        out = self._buf[self._pos : self._pos + n].view(t.dtype).view(t.shape)
        out.copy_(t)
        self._pos += -(-n // _ALIGN) * _ALIGN
        return out


def _advise_huge(addr: int, nbytes: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        length = nbytes - nbytes % HUGE
        if length == 0:
            return False
        ok = libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError) as exc:  # no madvise here: ordinary pages
        logger.debug("madvise unavailable: %s", exc)
        return False
    if not ok:
        logger.debug("MADV_HUGEPAGE refused (errno %d): the weights stay on ordinary pages", ctypes.get_errno())
    return ok
