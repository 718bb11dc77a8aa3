"""`final cartridge build|inspect|verify`, run as a real subprocess (python -m final.cartridge_commands)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from cartridges_helpers import DOCS, TINY

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "final.cartridge_commands", "cartridge", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_build_inspect_verify(tmp_path):
    out = tmp_path / "lighthouse.pt"
    r = cli("build", "--text", str(DOCS / "lighthouse.txt"), "--out", str(out), "--model", TINY)
    assert r.returncode == 0, r.stderr
    assert out.is_file() and Path(str(out) + ".manifest.json").is_file()

    r = cli("inspect", str(out), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert (info["num_layers"], info["num_kv_heads"], info["head_dim"], info["num_frozen_tokens"]) == (2, 2, 16, 1)
    assert info["checksum"] == "ok" and info["manifest"]["model_id"] == TINY and info["finite"]
    assert info["manifest"]["source_document"].endswith("lighthouse.txt")

    r = cli("verify", str(out), "--text", str(DOCS / "lighthouse.txt"), "--model", TINY, "--max-new-tokens", "8",
            "--tolerance", "1e-3")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "max logit diff:" in r.stdout and "token agreement: 1.0000 (3/3 same answer)" in r.stdout
    diff = float(r.stdout.split("max logit diff:")[1].split()[0])
    assert diff < 1e-3

    # Verifying against a different text is caught (the cartridge does not stand for it).
    r = cli("verify", str(out), "--text", str(DOCS / "robot.txt"), "--model", TINY)
    assert r.returncode == 2 and "num_tokens" in r.stderr


def test_safetensors_and_raw_mode(tmp_path):
    out = tmp_path / "planet.safetensors"
    r = cli("build", "--text", str(DOCS / "planet.txt"), "--out", str(out), "--model", TINY, "--raw",
            "--save-dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    r = cli("inspect", str(out))
    assert r.returncode == 0 and "bfloat16" in r.stdout and "checksum           ok" in r.stdout
    r = cli("verify", str(out), "--text", str(DOCS / "planet.txt"), "--model", TINY, "--raw", "--json",
            "--question", " How many moons?", "--max-new-tokens", "6")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["questions"] == 1 and report["max_logit_diff"] >= 0
    # convert back to the cartridges repo's .pt layout, keeping the manifest's identity
    r = cli("convert", str(out), str(tmp_path / "planet.pt"), "--save-dtype", "float32")
    assert r.returncode == 0, r.stderr
    r = cli("inspect", str(tmp_path / "planet.pt"), "--json")
    info = json.loads(r.stdout)
    assert info["dtype"] == "float32" and info["manifest"]["cartridge_id"] == "planet" and info["checksum"] == "ok"


def test_bad_files_exit_with_a_typed_message(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"\x01" * 100)
    r = cli("inspect", str(tmp_path / "junk.pt"))
    assert r.returncode == 2 and "junk.pt" in r.stderr and "field 'file'" in r.stderr
    r = cli("inspect", str(tmp_path / "none.pt"))
    assert r.returncode == 2 and "field 'path'" in r.stderr
    r = cli("build", "--text", str(tmp_path / "none.txt"), "--out", str(tmp_path / "x.pt"), "--model", TINY)
    assert r.returncode == 2 and "field 'text'" in r.stderr
