"""`final bench --quick --json`: runs every measurement for real on the tiny model and prints one JSON object.

Only the shape and the internal consistency of the figures are checked: tests never assert on time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick_result() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "final.cli", "bench", "--quick", "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout[-2000:]  # exactly one JSON object on stdout
    return json.loads(lines[0])


def test_quick_json_has_every_measurement(quick_result):
    res = quick_result
    assert {"p1", "p2", "p3", "p4", "machine", "roofline"} <= set(res)
    for key in ("p1", "p2", "p3"):
        assert {"ours", "reference", "ratio", "goal", "met"} <= set(res[key]), key
    assert {"ms_per_prompt", "ours", "reference", "ratio", "met"} <= set(res["p4"])
    assert res["machine"]["device"] == "cpu" and res["machine"]["cores"] >= 1


def test_quick_figures_are_consistent(quick_result):
    p1 = quick_result["p1"]
    assert p1["ours"] > 0 and p1["reference"] > 0
    assert p1["ratio"] == pytest.approx(p1["ours"] / p1["reference"], rel=1e-2)
    for row in p1["rows"]:  # greedy parity is part of the benchmark's claim: fp32 must match HF exactly
        if row["dtype"] == "fp32":
            assert row["greedy_parity"] == f"{row['batch']}/{row['batch']}"
    p2 = quick_result["p2"]
    assert [r["p"] for r in p2["rows"]] == sorted(r["p"] for r in p2["rows"]) and p2["rows"]
    assert all(r["ours_ms"] > 0 and r["reference_ms"] > 0 for r in p2["rows"])
    p3 = quick_result["p3"]
    # rows share the cartridge: the bytes held for all rows are those of one cartridge, not one per row
    assert p3["all_rows"]["running_rows"] == p3["rows"] > 1
    assert p3["ours"] == p3["reference"] == p3["cartridge_bytes"] and p3["ratio"] == 1.0
    p4 = quick_result["p4"]
    assert p4["prompts"] > 0 and p4["ours"] > 0 and p4["reference"] > 0


def test_table_output_names_each_measurement():
    from final.bench.cli import report

    res = {"machine": {"date": "d", "cpu": "c", "cores": 2, "torch": "t", "torch_threads": 2, "device": "cpu"},
           "model": "m",
           "p4": {"prompts": 4, "new_tokens": 2, "ours_s": 0.02, "reference_s": 0.01, "ms_per_prompt": 2.5,
                  "goal_ms_per_prompt": 1.0, "met": False}}
    text = report(res)
    assert "P4 wrapper overhead" in text and "NOT met" in text and "2.500 ms/prompt" in text


def test_table_output_has_the_dp_line():
    """`--only dp` starts Ray and three engines, so it stays out of the quick run (Ray starts only in
    tests/test_pool.py); its table line is checked here."""
    from final.bench.cli import report

    res = {"machine": {"date": "d", "cpu": "c", "cores": 2, "torch": "t", "torch_threads": 2, "device": "cpu"},
           "model": "m",
           "dp": {"ours": 80.0, "reference": 40.0, "ratio": 2.0, "replicas": 2, "prompts": 8, "new_tokens": 4,
                  "rows_per_replica": {0: 4, 1: 4}, "same_tokens": "8/8", "note": "share the cores"}}
    text = report(res)
    assert "DP data parallelism" in text and "2.00x" in text and "same greedy tokens 8/8" in text


def test_soak_smoke():
    """`final bench --only soak` end to end on a few requests: a real `final serve` subprocess, every request
    answered as it should be (weight updates among cartridge loads and evictions), no cartridge reference left
    behind, the server alive and exiting 0 on SIGTERM.
    (The 4,000-request figures are bench/RESULTS.md's; RSS drift and latency are not asserted.)"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "final.cli", "bench", "--only", "soak", "--quick", "--json",
                           "--soak-requests", "60", "--soak-concurrency", "4"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    soak = json.loads(proc.stdout.strip().splitlines()[-1])["soak"]
    assert soak["requests"] == 60 and sum(soak["kinds"].values()) == 60
    # weight updates interleaved with the cartridge traffic, each answered with the next version
    assert soak["weight_updates"] == soak["kinds"]["weights"] >= 1
    assert soak["unexpected"] == 0, soak["unexpected_examples"]
    assert soak["cartridge_refs_end"] == 0 and soak["alive"] and soak["exit_code_after_sigterm"] == 0
    assert soak["p50_ms"] > 0 and soak["rss_end_mb"] > 0
    assert len(soak["rss_series_mb"]) == 10 and soak["rss_half_mb"] == soak["rss_series_mb"][4]  # every tenth


def test_multiturn_smoke():
    """`final bench --only multiturn` end to end on the tiny model: every peer plays the conversations, the cached
    engine reports the turns' history as cached tokens and the uncached one none, and a prompt's samples share one
    prefill (the figures themselves are bench/RESULTS.md's; no time is asserted)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "final.cli", "bench", "--only", "multiturn", "--quick", "--json",
                           "--mt-batches", "1,2", "--mt-turns", "2"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    mt = json.loads(proc.stdout.strip().splitlines()[-1])["multiturn"]
    assert [b["batch"] for b in mt["batches"]] == [1, 2] and mt["llama_cpp"].startswith("skipped")
    for b in mt["batches"]:
        rows = b["rows"]
        assert set(rows) == {"ours, prefix cache", "ours, no cache", "HF generate"}
        assert all(len(r["ttft_ms"]) == 2 for r in rows.values())
        assert rows["ours, prefix cache"]["cached_tokens"] >= b["batch"] * 500  # turn 2 reads turn 1's history
        assert rows["ours, no cache"]["cached_tokens"] == 0
        assert all(0 < r["after_first_s"] < r["wall_s"] for r in rows.values())
        assert 0 < b["ratios"]["cache_floor"] <= b["ratios"]["cache_over_no_cache"]
    samples = mt["samples"]
    assert samples["cached_tokens"] == [0] + [samples["prompt_tokens"]] * (samples["n"] - 1)
    assert samples["cached_tokens_without"] == [0] * samples["n"]
