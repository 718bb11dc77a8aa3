"""scripts/install.sh's choice of the CPU torch (`--dry-run` says it and changes nothing), against real pip runs:
a local CPU wheel pip's configuration finds (the dev machines' case: nothing downloaded), else the PyTorch CPU index
(here a real HTTP server on 127.0.0.1 standing in for download.pytorch.org), else pip's configured index with a
warning. pip's own configuration is replaced by the test's (PIP_CONFIG_FILE=/dev/null, PIP_FIND_LINKS)."""

from __future__ import annotations

import functools
import http.server
import os
import platform
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"


def wheel(folder: Path, version: str) -> Path:
    """A real (tiny) wheel named torch: pip reads its metadata as it would the real one's."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"torch-{version}-py3-none-any.whl"
    info = f"torch-{version}.dist-info"
    files = {"torch/__init__.py": "", f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


@pytest.fixture
def index(tmp_path):
    """A PyTorch-style simple index on 127.0.0.1 whose torch page lists the wheels written into `page`."""
    page = tmp_path / "site" / "whl" / "cpu" / "torch" / "index.html"
    page.parent.mkdir(parents=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "site"))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield page, f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
    server.shutdown()


def dry_run(find_links: Path, index_url: str) -> str:
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": str(find_links),
           "FINAL_TORCH_INDEX": index_url, "PYTHON": sys.executable}
    for key in ("FINAL_EXTRAS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        env.pop(key, None)
    done = subprocess.run(["bash", "scripts/install.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture(autouse=True)
def cpu_machine():
    if subprocess.run(["bash", "-c", "command -v nvidia-smi"], capture_output=True).returncode == 0:
        pytest.skip("install.sh pins the CPU torch only on machines without a GPU")


def test_a_local_cpu_wheel_is_used_as_pip_finds_it(tmp_path, index):
    page, url = index
    page.write_text("")  # the index has nothing: it must not matter
    out = dry_run(wheel(tmp_path / "wheels", "2.13.0+cpu").parent, url)
    assert out == ("install.sh --dry-run: torch 2.13.0 (CPU) from local: torch 2.13.0+cpu found by pip's own "
                   "configuration (a local wheel): nothing downloaded")


def test_without_a_local_cpu_wheel_the_pytorch_cpu_index_is_an_extra_index(tmp_path, index):
    page, url = index
    name = f"torch-2.13.0%2Bcpu-{TAG}-{TAG}-manylinux_2_28_{platform.machine()}.whl"
    page.write_text(f'<html><body><a href="/whl/cpu/{name}#sha256=00">{name}</a><br/></body></html>')
    out = dry_run(wheel(tmp_path / "wheels", "2.13.0").parent, url)  # a local wheel, but not the CPU build
    assert out == (f"install.sh --dry-run: torch 2.13.0 (CPU) from pytorch: torch 2.13.0+cpu from the PyTorch CPU "
                   f"index {url} [pip --extra-index-url {url}]")


def test_with_neither_it_says_the_configured_index_may_be_the_cuda_build(tmp_path, index):
    page, url = index
    other = f"torch-2.12.0%2Bcpu-{TAG}-{TAG}-manylinux_2_28_{platform.machine()}.whl"  # another version only
    page.write_text(f'<a href="/whl/cpu/{other}">{other}</a>')
    (tmp_path / "empty").mkdir()
    assert "from configured: no CPU wheel of torch 2.13.0 found locally or on" in dry_run(tmp_path / "empty", url)
    assert "CUDA build" in dry_run(tmp_path / "empty", "http://127.0.0.1:9/unreachable")
