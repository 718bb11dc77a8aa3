"""The processes an in-process SGLang engine starts: find them, watch them, end them.

SGLang 0.5.2's Engine.shutdown kills every child of the process (a second engine, a notebook's helpers) and a
scheduler that dies either SIGQUITs its parent (whose default action kills it) or, if it dies before saying
"ready", leaves the parent blocked forever on a pipe. This module keeps each engine to its own processes and turns
a death into a message for the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import signal
import sys
import threading
from typing import Callable, Iterator

import psutil

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often a ProcessWatch looks at an engine's processes


@contextlib.contextmanager
def keep_event_loop_policy() -> Iterator[None]:
    """SGLang (0.5.2 and 0.5.12) installs uvloop's event-loop policy when sglang/srt/entrypoints/engine.py,
    managers/tokenizer_manager.py or entrypoints/http_server.py is imported. A new policy forgets every thread's
    current loop (the policy keeps them), so the engine thread's loop, a notebook's, a trainer's, are gone for
    `asyncio.get_event_loop()`, which veRL calls. A library must not change that for its host process: restore it."""
    policy = asyncio.get_event_loop_policy()
    try:
        yield
    finally:
        if asyncio.get_event_loop_policy() is not policy:
            asyncio.set_event_loop_policy(policy)


def cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel every task of an engine's loop (run on that loop): after a death, whatever waits there ends."""
    for task in asyncio.all_tasks(loop):
        task.cancel()


def new_children(before: set[int]) -> list[psutil.Process]:
    """Children of this process not in `before`, minus multiprocessing's shared helpers (the resource tracker that
    `spawn` starts on first use serves the whole process, and ignores SIGTERM)."""
    shared = {getattr(mp.resource_tracker._resource_tracker, "_pid", None),
              getattr(mp.forkserver._forkserver, "_forkserver_pid", None)}
    return [p for p in psutil.Process().children() if p.pid not in before and p.pid not in shared]


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_processes(processes: list[psutil.Process], timeout: float = 10.0) -> None:
    """Terminate processes (and their children), then kill what is left after `timeout` seconds."""
    tree = []
    for p in processes:
        with contextlib.suppress(psutil.Error):
            tree += p.children(recursive=True) + [p]
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(tree, timeout=timeout)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=timeout)


def _launch_frame(thread_ident: int):
    """SGLang's `_launch_subprocesses` frame, while that thread is inside it (engine start), else None."""
    frame = sys._current_frames().get(thread_ident)
    while frame is not None and frame.f_code.co_name != "_launch_subprocesses":
        frame = frame.f_back
    return frame


def launched_processes(thread_ident: int) -> list[mp.Process]:
    """The processes SGLang's `_launch_subprocesses` has started so far (scheduler, detokenizer), from its frame.
    Unlike a look at this process's children, this sees a child that already died and was reaped: starting the
    next process reaps finished ones (multiprocessing's _cleanup), so a scheduler dying within moments of its
    start would never be seen alive, and the parent would wait for its "ready" forever."""
    frame = _launch_frame(thread_ident)
    if frame is None:
        return []
    local = frame.f_locals
    procs = list(local.get("scheduler_procs") or []) + [local.get("detoken_proc")]
    return [p for p in procs if isinstance(p, mp.process.BaseProcess) and p.pid is not None]


def release_start(thread_ident: int) -> None:
    """A scheduler that dies before saying "ready" leaves SGLang's `_launch_subprocesses` (on the engine thread)
    reading a pipe whose write end it still holds itself, forever. Close that end, so the read ends in EOFError."""
    frame = _launch_frame(thread_ident)
    writer = frame.f_locals.get("writer") if frame is not None else None
    if isinstance(writer, mp.connection.Connection) and not writer.closed:
        writer.close()


def survive_sigquit() -> None:
    """SGLang's scheduler SIGQUITs its parent when it dies; by default that kills this process (a notebook
    kernel, a trainer). Log instead: the ProcessWatch reports the death. Only the main thread can do this."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGQUIT) == signal.SIG_DFL:
        signal.signal(signal.SIGQUIT, lambda signum, frame: logger.error(
            "an SGLang child process reported a failure (SIGQUIT); see its log above"))


class ProcessWatch:
    """Polls an engine's processes; calls on_death(pid) once if one exits before stop(). Until started(), the
    engine's processes are those SGLang launched from `start_thread` and any new child of this process."""

    def __init__(self, on_death: Callable[[int], None], interval: float, start_thread: int | None = None):
        self._on_death = on_death
        self._interval = interval
        self._start_thread = start_thread
        self._foreign = {p.pid for p in psutil.Process().children()}
        self._procs: dict[int, psutil.Process] = {}
        self._started = False  # until then every new child is taken as the engine's
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="final-sglang-watch")
        self._thread.start()

    def started(self, processes: list[psutil.Process]) -> None:
        self._procs = {p.pid: p for p in processes}
        self._started = True

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            if not self._started:
                if self._start_thread is not None:
                    dead = [p.pid for p in launched_processes(self._start_thread) if p.exitcode is not None]
                    if dead and not self._stop.is_set() and not self._started:
                        self._on_death(dead[0])
                        return
                for p in new_children(self._foreign):
                    self._procs.setdefault(p.pid, p)
            for pid, p in list(self._procs.items()):
                if not alive(p) and not self._stop.is_set():
                    self._on_death(pid)
                    return
