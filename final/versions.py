"""PolicyVersions: which weights a call runs on, and the one rule that keeps a call on one version.

Calls read the weights; an update writes them. A call holds a read for its whole duration (every row, every
turn of a tool-calling conversation, every token of a stream), so it starts and finishes on one version and
reports that version for each row. An update waits for the calls in flight to finish, and calls that arrive
meanwhile wait for the update (the writer goes first, so a stream of calls never starves it). Then the version
goes up by one. What asynchronous RL trainers need from it: every output row says which policy produced it.

The same object guards an InferenceEngine and a ReplicaPool (whose replicas then never serve two versions inside
one call). Thread-safe; the awaitable forms wait on a worker thread only when they must wait at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import AsyncIterator, Iterator

from final.errors import EngineError


class PolicyVersions:
    def __init__(self, version: int = 0):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer: int | None = None  # the thread holding the write, if any
        self._writers_waiting = 0
        self.version = version

    # ---- calls -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def reading(self) -> Iterator[int]:
        """Hold the weights for a call; yields the version it runs on."""
        self._check_not_writer()
        version = self._begin_read()
        try:
            yield version
        finally:
            self._end_read()

    @contextlib.asynccontextmanager
    async def areading(self) -> AsyncIterator[int]:
        """reading() for an event loop: waits on a worker thread (only while an update runs or waits)."""
        with self._cond:
            version = self._enter() if self._readable() else None
        if version is None:
            waiting = asyncio.get_running_loop().run_in_executor(None, self._begin_read)
            try:
                version = await asyncio.shield(waiting)
            except asyncio.CancelledError:  # the caller left while waiting: give back what the thread takes
                waiting.add_done_callback(lambda f: f.cancelled() or f.exception() or self._end_read())
                raise
        try:
            yield version
        finally:
            self._end_read()

    # ---- updates -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def writing(self) -> Iterator[int]:
        """Hold the weights alone (no call in flight); yields the version after this update. The version goes up
        only if the block ends without an exception (a refused update leaves the old weights and version)."""
        with self._alone(bump=True):
            yield self.version + 1

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the weights alone without changing the version (release/resume of the engine's memory)."""
        with self._alone(bump=False):
            yield

    @contextlib.contextmanager
    def _alone(self, bump: bool) -> Iterator[None]:
        self._check_not_writer()
        with self._cond:
            self._writers_waiting += 1
            try:
                self._cond.wait_for(lambda: self._readers == 0 and self._writer is None)
            finally:
                self._writers_waiting -= 1
            self._writer = threading.get_ident()
        ok = False
        try:
            yield
            ok = True
        finally:
            with self._cond:
                if ok and bump:
                    self.version += 1
                self._writer = None
                self._cond.notify_all()

    @property
    def calls_in_flight(self) -> int:
        return self._readers

    # ---- internals ---------------------------------------------------------------------------------------
    def _readable(self) -> bool:
        return self._writer is None and self._writers_waiting == 0

    def _enter(self) -> int:
        """One more call holds the weights (under the lock, once they are readable): the version it runs on."""
        self._readers += 1
        return self.version

    def _begin_read(self) -> int:
        with self._cond:
            self._cond.wait_for(self._readable)
            return self._enter()

    def _end_read(self) -> None:
        with self._cond:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    def _check_not_writer(self) -> None:
        if self._writer == threading.get_ident():
            raise EngineError("a call or update was made while this thread holds the weights for an update "
                              "(from inside update_weights/release/resume): it would wait for itself")
