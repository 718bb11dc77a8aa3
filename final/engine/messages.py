"""What callers send to the engine thread, as typed messages (SGLang's scheduler takes typed requests and
dispatches on their type), and the Batch through which a submission's results come back.

A Batch is one submission: its rows finish one by one on the engine thread; `on_row` sees each (progress bars,
streams), and after the last one `finish` turns all the outputs into the caller's result on the engine thread
(batch-sized tensor work stays on the one thread that does tensor work) before the future resolves. So a
whole batch costs two thread crossings: the Submit going in and the future coming out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

logger = logging.getLogger(__name__)


class Batch:
    def __init__(self, rows: int, finish: Callable[[list[dict]], Any] | None = None,
                 on_row: Callable[[int, dict], None] | None = None):
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.outputs: list[dict | None] = [None] * rows
        self.remaining = rows
        self.finish = finish
        self.on_row = on_row
        self._lock = threading.Lock()

    def row_done(self, row: int, output: dict) -> None:
        """Record row `row`'s output; the last row resolves the future (with finish(outputs) when given)."""
        if self.on_row is not None:
            try:
                self.on_row(row, output)
            except Exception:  # noqa: BLE001 - a progress callback must not break the engine
                logger.exception("on_row callback failed")
        with self._lock:
            if self.future.done() or self.outputs[row] is not None:
                return
            self.outputs[row] = output
            self.remaining -= 1
            if self.remaining:
                return
        try:
            result = self.finish(self.outputs) if self.finish is not None else self.outputs
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self.fail(exc)
            return
        self._resolve(lambda: self.future.set_result(result))

    def fail(self, exc: BaseException) -> None:
        self._resolve(lambda: self.future.set_exception(exc))

    @staticmethod
    def _resolve(setter: Callable[[], None]) -> None:
        try:
            setter()
        except concurrent.futures.InvalidStateError:  # cancelled by its caller, or failed already
            pass


@dataclass
class Submission:
    """A batch handed to an engine: its future, and how to abort it (a caller that gives up frees its rows)."""

    future: concurrent.futures.Future
    abort: Callable[[], None]

    def result(self) -> Any:
        """Wait on this thread; an interrupt (Ctrl-C) aborts the rows first."""
        try:
            return self.future.result()
        except BaseException:
            if not self.future.done():
                self.abort()
            raise

    async def wait(self) -> Any:
        """Await from any event loop; a cancelled caller (a client hanging up) aborts the rows."""
        try:
            return await asyncio.wrap_future(self.future)
        except asyncio.CancelledError:
            self.abort()
            raise


@dataclass
class Submit:
    """New sequences to admit (validated by the caller); they report to their own Batch."""

    seqs: list[Any]


@dataclass
class Abort:
    """Abort the sequence with this rid, those in `rids` (one message for a whole request, so all its rows leave
    at the same step boundary), or every one: they finish with finish_reason "abort"."""

    rid: str = ""
    abort_all: bool = False
    message: str = "aborted"
    rids: frozenset[str] = frozenset()


@dataclass
class Call:
    """Run fn(runner) between steps on the engine thread (loading weights, building a cartridge)."""

    fn: Callable[[Any], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class Drain:
    """Run fn(runner) once no row is running or waiting: rows admitted before it finish first, rows submitted
    after it wait until it has run (a weight update: no row ever runs on two sets of weights)."""

    fn: Callable[[Any], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class Stop:
    """Fail what is left and end the engine thread."""
