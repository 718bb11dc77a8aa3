"""Admission control: how many rows one engine has taken on and not yet finished, bounded by
limits.max_queued_rows.

Without a bound, every request joins the engine's waiting queue and a burst (or one client sending many calls)
makes every later request wait behind it until clients time out. With one, a call that would overflow the queue
is refused at once with OverloadedError (HTTP 429 with Retry-After) and nothing of it runs. A call too big to
ever fit is refused earlier, by final.request.prepare.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from final.errors import OverloadedError

RETRY_AFTER_S = 1.0  # what a refused caller is told: rows finish continuously, so a short wait is usually enough


class Admission:
    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self.rows = 0  # admitted and not yet finished
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self, rows: int) -> Iterator[None]:
        """Count `rows` as queued while the block runs; raise OverloadedError if they do not fit now."""
        with self._lock:
            if self.rows + rows > self.max_rows:
                raise OverloadedError(f"the engine is full: {self.rows} rows queued, {rows} more would exceed "
                                      f"limits.max_queued_rows={self.max_rows}; retry later", RETRY_AFTER_S)
            self.rows += rows
        try:
            yield
        finally:
            with self._lock:
                self.rows -= rows
