"""What one InferenceEngine call needs around it: its deadline, its progress bar and tool-event callback, and
whether the caller is inside a running event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
from typing import Any, AsyncIterator, Callable, Iterator

from final.errors import DeadlineError
from final.request import Request


async def within_deadline(work: Any, deadline: float | None) -> Any:
    """`work` awaited; past `deadline` seconds it is cancelled (its rows aborted) and DeadlineError raised."""
    if deadline is None:
        return await work
    task = asyncio.ensure_future(work)
    if not await _finished_in(task, deadline):
        raise DeadlineError(deadline)
    return task.result()  # the work's own error (a tool's TimeoutError too) as it raised it


async def until_deadline(updates: AsyncIterator[Any], deadline_s: float | None) -> AsyncIterator[Any]:
    """`updates` until the deadline: then DeadlineError (the stream under it is cancelled, aborting its rows)."""
    if deadline_s is None:
        async for item in updates:
            yield item
        return
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        step = asyncio.ensure_future(updates.__anext__())
        if not await _finished_in(step, max(end - loop.time(), 0.0)):
            raise DeadlineError(deadline_s)
        try:
            item = step.result()
        except StopAsyncIteration:
            return
        yield item


async def _finished_in(task: asyncio.Future, timeout: float) -> bool:
    """Whether `task` finished within `timeout` s; if not (or if our caller is cancelled meanwhile) it is cancelled
    and waited for, so its rows are aborted before the caller goes on.

    The outcome is read from the task's state, not the clock: a loop fires a timer up to a clock tick early
    (uvloop's ticks are milliseconds), and "now < end" once took an expired deadline for the work's own
    TimeoutError (a 500 in CI where a 504 was due)."""
    try:
        await asyncio.wait({task}, timeout=timeout)
    finally:
        expired = not task.done()
        if expired:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return not expired


def loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def run_blocking(coro: Any) -> Any:
    """asyncio.run(coro), also from inside a running event loop (a notebook cell), as InferenceEngine allows."""
    if not loop_running():
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def off_loop(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) awaited from an event loop, run on a worker thread (a blocking call a server makes)."""
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kwargs))


def progress_bar(rows: int) -> Any:
    """A call's bar over its rows (tqdm's, imported when a call shows one)."""
    from tqdm.auto import tqdm

    return tqdm(total=rows, desc="generate", unit="seq")


class CallObserver:
    """Per call: a tqdm bar over finished rows, and the caller's tool-event callback."""

    def __init__(self, bar: Any, on_event: Callable[[dict], None] | None):
        self.bar, self.on_event = bar, on_event
        self._lock = threading.Lock()

    @classmethod
    @contextlib.contextmanager
    def open(cls, request: Request, on_event: Callable[[dict], None] | None) -> Iterator["CallObserver | None"]:
        bar = progress_bar(request.rows) if request.show_progress else None
        try:
            yield cls(bar, on_event) if bar is not None or on_event is not None else None
        finally:
            if bar is not None:
                bar.close()

    def row_done(self) -> None:
        if self.bar is not None:
            with self._lock:
                self.bar.update()

    def tool_event(self, event: dict) -> None:
        if self.on_event is not None:
            self.on_event(event)


# ---- a call's cartridges ------------------------------------------------------------------------------------
@contextlib.contextmanager
def holding(cartridges: Any, request: Request) -> Iterator[list[tuple[str, ...]] | None]:
    """The request's cartridge ids per prompt, loaded (specs) and held so the store (a CartridgeService, or None)
    cannot evict them while the call runs."""
    if request.cartridges is None or cartridges is None:
        yield _ids(request.cartridges)
        return
    with cartridges.using(request.cartridge_refs()):
        yield _ids(request.cartridges)


@contextlib.asynccontextmanager
async def aholding(cartridges: Any, request: Request) -> AsyncIterator[list[tuple[str, ...]] | None]:
    """holding() for event loops: loading reads files, so it runs on a worker thread."""
    if request.cartridges is None or cartridges is None:
        yield _ids(request.cartridges)
        return
    using = cartridges.using(request.cartridge_refs())
    loading = asyncio.get_running_loop().run_in_executor(_cartridge_loads(), using.__enter__)
    try:
        await asyncio.shield(loading)
    except asyncio.CancelledError:  # the caller left mid-load: release what the load thread takes
        loading.add_done_callback(lambda f: f.cancelled() or f.exception() or using.__exit__(None, None, None))
        raise
    try:
        yield _ids(request.cartridges)
    finally:
        using.__exit__(None, None, None)


@functools.lru_cache(maxsize=1)
def _cartridge_loads() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for requests' cartridge loads: a remote source may hold one for up to limits.cartridge_fetch_s,
    so they get a pool of their own and never starve the event loop's default executor."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="final-cartridge-load")


def _ids(cartridges: list[tuple[Any, ...]] | None) -> list[tuple[str, ...]] | None:
    """Per-prompt cartridge ids: a spec's id is its `id` (or its path)."""
    if cartridges is None:
        return None
    return [tuple(c if isinstance(c, str) else (c.get("id") or c.get("path")) for c in row) for row in cartridges]
