"""`final bench` runs each measurement (and each llama.cpp row) in its own process: a peer that dies - here a real
child process that kills itself with SIGILL, as llama.cpp's Q8_0 does on a CPU its build does not fit - is
reported in the output, and the benchmark goes on with the next measurement."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from final.bench import cli
from final.bench.isolate import died, isolated

TESTS = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def importable_helpers(monkeypatch):
    """The children import tests/bench_crash.py."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))


def test_a_child_that_dies_is_reported_with_its_signal_and_output():
    got = isolated("bench_crash:die", {})
    assert got["crashed"].startswith("killed by SIGILL (an illegal instruction")
    assert "about to execute an instruction this CPU lacks" in got["output"]
    assert "SIGSEGV" in isolated("bench_crash:die", {"signum": int(signal.SIGSEGV)})["crashed"]
    assert isolated("bench_crash:leave", {"status": 3})["crashed"] == "exited with status 3 without a result"
    assert isolated("bench_crash:fail", {"message": "no llama"}) == {"failed": "ValueError: no llama"}
    assert isolated("bench_crash:echo", {"rows": [[1, 2]], "mode": "int8"}) == \
        {"got": {"rows": [[1, 2]], "mode": "int8"}}
    assert died(-int(signal.SIGKILL)).startswith("killed by SIGKILL")


def test_the_benchmark_reports_a_crashed_measurement_and_runs_the_next(monkeypatch, capsys):
    monkeypatch.setattr(cli, "MEASUREMENTS", {"peer_boom": "bench_crash:sigill_section",
                                              "ok": "bench_crash:ok_section"})
    assert cli.main(["--quick", "--json", "--only", "peer_boom,ok"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["peer_boom"]["crashed"].startswith("killed by SIGILL")
    assert res["ok"]["repeats"] == 1 and res["ok"]["quick"] is True  # measured after the crash
    assert res["ok"]["model"].endswith("tiny-random-llama")
    text = cli.report({k: v for k, v in res.items() if k != "ok"})  # the table: the crash, with its output
    assert "peer_boom: crashed: killed by SIGILL" in text and "| about to execute" in text
