"""RolloutThread: one thread that owns an event loop and makes every rollout call.

veRL's generate_sequences calls `asyncio.get_event_loop().run_until_complete(...)`, which fails inside a running
loop (a Jupyter cell, an async server), and SGLang binds to the loop it was created on. Creating the rollout
and calling it on this thread, always, makes both work from scripts, from other threads and from notebooks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, TypeVar

from final.errors import EngineError

T = TypeVar("T")


class RolloutThread:
    def __init__(self, name: str = "final-rollout"):
        self.loop = asyncio.new_event_loop()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                                           initializer=asyncio.set_event_loop,
                                                           initargs=(self.loop,))
        self._ident: int | None = self._pool.submit(threading.get_ident).result()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        return self._pool.submit(fn, *args, **kwargs)

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run fn on the rollout thread and wait (directly when already on it)."""
        if threading.get_ident() == self._ident:
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    async def arun(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Await fn on the rollout thread from any running event loop."""
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if not self.loop.is_closed():
            self.loop.close()


def run_until_complete(coro) -> Any:
    """veRL's `asyncio.get_event_loop().run_until_complete(coro)`, made safe for direct callers.

    A thread with no (or a closed) current loop gets a fresh one; inside a running loop (a Jupyter cell) this
    raises a clear error instead of deadlocking — InferenceEngine avoids that case with its RolloutThread.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        coro.close()
        raise EngineError("generate_sequences() cannot block inside a running event loop; use "
                          "InferenceEngine.agenerate(), which runs rollouts on their own thread")
    try:
        loop = asyncio.get_event_loop()
    except RuntimeError:
        loop = None
    if loop is None or loop.is_closed():
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
    return loop.run_until_complete(coro)


class LoopThread:
    """A thread running an event loop forever, for a backend whose work is coroutines (an HTTP client): calls
    from any thread or loop hand it coroutines and get concurrent futures, and their work overlaps."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()


async def gather_or_cancel(coros: list) -> list:
    """asyncio.gather, except that one failure (or a cancelled caller) cancels the rest before it propagates."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
