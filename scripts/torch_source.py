"""Where scripts/install.sh gets the CPU build of torch on a machine without a GPU (run with the venv's Python).

PyPI's Linux torch wheel is the CUDA build (GBs of nvidia-* packages); the CPU build ("2.13.0+cpu") lives on the
PyTorch CPU index. In order:
  local       pip's own configuration already finds a CPU wheel of that version without an index (a wheel under
              --find-links, as on the dev machines): install as configured, nothing downloaded
  pytorch     the PyTorch CPU index lists a CPU wheel for this Python and machine: install with it as an extra
              index (pip prefers 2.13.0+cpu over PyPI's 2.13.0: a local version label sorts higher)
  configured  neither: pip's configured index, which on PyPI means the CUDA build; said loudly
Prints two lines: the source's name and what it means, then the pip arguments to add (possibly empty).

    python scripts/torch_source.py 2.13.0 [--index URL]      (FINAL_TORCH_INDEX overrides the index too)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def local_cpu_wheel(version: str) -> str | None:
    """The version pip resolves torch==version to from its find-links alone (no index, nothing installed or
    downloaded: a dry run reading the local wheel's metadata), if that is a CPU build."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-deps",
                               "--ignore-installed", "--no-index", "--report", str(report), f"torch=={version}"],
                              capture_output=True, text=True)
        if done.returncode != 0 or not report.exists():
            return None
        found = [item["metadata"]["version"] for item in json.loads(report.read_text()).get("install", [])]
    return next((v for v in found if v.endswith("+cpu")), None)


def index_has_cpu_wheel(index: str, version: str, timeout: float = 20.0) -> bool:
    """Whether the index's torch page lists the CPU wheel of `version` for this Python and machine."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    try:
        with urllib.request.urlopen(f"{index.rstrip('/')}/torch/", timeout=timeout) as page:
            text = page.read().decode("utf-8", "replace").replace("%2B", "+")
    except (urllib.error.URLError, OSError, ValueError):
        return False
    wheel = f"torch-{version}+cpu-{tag}-{tag}-"
    return any(wheel in line and platform.machine() in line for line in text.split(">"))


def decide(version: str, index: str) -> tuple[str, str, list[str]]:
    """(source, what it means, extra pip arguments)."""
    local = local_cpu_wheel(version)
    if local:
        return "local", f"torch {local} found by pip's own configuration (a local wheel): nothing downloaded", []
    if index_has_cpu_wheel(index, version):
        return "pytorch", f"torch {version}+cpu from the PyTorch CPU index {index}", ["--extra-index-url", index]
    return "configured", (f"no CPU wheel of torch {version} found locally or on {index}: pip's configured index "
                          "(on PyPI, the CUDA build: GBs)"), []


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("version")
    parser.add_argument("--index", default=os.environ.get("FINAL_TORCH_INDEX") or PYTORCH_CPU_INDEX)
    args = parser.parse_args()
    source, what, pip_args = decide(args.version, args.index)
    print(f"{source}: {what}")
    print(" ".join(pip_args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
