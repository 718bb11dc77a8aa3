"""Run a benchmark's part in its own Python process, so that a peer's crash is a line of the report, not the end
of the run (llama.cpp's Q8_0 dies with SIGILL where its build uses an instruction the CPU lacks; HF's kernels can
abort the same way).

    isolated("final.bench.cli:section", {"key": "p1", ...})   # the function's JSON result, or {"crashed": ...}

The child is `python -m final.bench.isolate`: it reads {"target", "kwargs"} as JSON on stdin, calls
`module:function(**kwargs)` and writes the JSON result to the file named on its command line. Nothing but JSON
crosses (no pickle). A child killed by a signal, exiting without a result, or raising is reported as
{"crashed": why, "output": its last lines of output} (a raise as {"failed": ...}); the caller carries on.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import final

_WHY = {signal.SIGILL: "an illegal instruction: the code was built for a CPU feature this machine lacks",
        signal.SIGSEGV: "a segmentation fault", signal.SIGABRT: "an abort", signal.SIGKILL: "killed (out of memory?)",
        signal.SIGBUS: "a bus error", signal.SIGFPE: "an arithmetic fault"}
TAIL = 2000  # characters of a dead child's output kept in the report


def isolated(target: str, kwargs: dict, timeout: float | None = None) -> dict:
    """`target` ("module:function") called with **kwargs in a child Python: its result (a JSON object), or
    {"crashed": why, "output": ...} / {"failed": "Type: message"} when the child died or raised."""
    env = dict(os.environ)
    root = str(Path(final.__file__).resolve().parents[1])  # the child imports this very `final`
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="final-bench-") as tmp:
        out, log = Path(tmp) / "result.json", Path(tmp) / "output.log"
        with log.open("w") as output:
            try:
                proc = subprocess.run([sys.executable, "-m", "final.bench.isolate", str(out)], env=env, text=True,
                                      input=json.dumps({"target": target, "kwargs": kwargs}), stdout=output,
                                      stderr=subprocess.STDOUT, timeout=timeout)
            except subprocess.TimeoutExpired:
                return {"crashed": f"ran past {timeout:g} s and was killed", "output": _tail(log)}
        if proc.returncode == 0 and out.exists():
            return json.loads(out.read_text())
        return {"crashed": died(proc.returncode), "output": _tail(log)}


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-TAIL:]


def died(returncode: int) -> str:
    """How a child process ended, in words (a negative code is the signal that killed it)."""
    if returncode < 0:
        sig = signal.Signals(-returncode)
        return f"killed by {sig.name} ({_WHY.get(sig, signal.strsignal(sig) or 'a signal')})"
    return f"exited with status {returncode} without a result"


def _child(out: str) -> int:
    request = json.loads(sys.stdin.read())
    module, _, name = request["target"].partition(":")
    try:
        result = getattr(importlib.import_module(module), name)(**request["kwargs"])
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which carries on
        result = {"failed": f"{type(exc).__name__}: {exc}"}
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    from final.cli import quiet

    quiet()
    sys.exit(_child(sys.argv[1]))
