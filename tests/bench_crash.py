"""Benchmark parts that crash on purpose, for tests/test_bench_isolate.py: each runs in a real child process
(final.bench.isolate), which really dies (SIGILL, an exit without a result) or really raises."""

from __future__ import annotations

import os
import resource
import signal


def die(signum: int = signal.SIGILL, **_: object) -> None:
    """Kill this process with `signum`, as an illegal instruction in a peer's kernel would (no core file)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    print("about to execute an instruction this CPU lacks", flush=True)
    os.kill(os.getpid(), signum)


def leave(status: int = 3) -> None:
    os._exit(status)


def fail(message: str) -> None:
    raise ValueError(message)


def echo(**kwargs: object) -> dict:
    return {"got": kwargs}


def sigill_section(args, model: str, repeats: int) -> dict:
    """A `final bench` measurement whose peer dies with SIGILL."""
    die()
    return {}


def ok_section(args, model: str, repeats: int) -> dict:
    return {"ok": {"model": model, "repeats": repeats, "quick": args.quick}}
