"""Helpers for the serve/tokasaurus/client tests: a real `final serve` on an ephemeral 127.0.0.1 port, real
cartridge files, and a real HTTP server that fails its first N calls before proxying to the real server.

Test modules load it with `pytest_plugins = ["serve_helpers"]` (fixtures `served`, `carts`) and import its helpers,
so pytest must not try to rewrite it after that import: PYTEST_DONT_REWRITE (it has no asserts)."""

from __future__ import annotations

import http.server
import json
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from conftest import tiny_config

DOC_A = "The lighthouse keeper of Orvanis is called Mara Quill. She keeps three cats named Pip, Jot and Fennel."
DOC_B = "Tallow Creek floods every April. The ferry to Dunmore stops running when the water passes the red mark."


def spawn_serve(*args: str, env: dict | None = None, cwd: Path | str | None = None,
                prefix: tuple[str, ...] = ()) -> tuple[str, subprocess.Popen]:
    """`final serve ARGS --port 0` as its own process: its URL (read from the startup line) and the process. Its
    stderr keeps being drained afterwards, so the server never blocks on a full pipe. `prefix`: a command that
    runs it (setpriv, to drop root's right to read any file)."""
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "final.cli", "serve", *args, "--port", "0"], env=env,
                            cwd=cwd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if m := re.search(r"running on (http://127\.0\.0\.1:\d+)", line):
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return m.group(1), proc
    proc.kill()
    proc.wait()
    pytest.fail("final serve did not start:\n" + "".join(seen))


def stop_serve(proc: subprocess.Popen) -> None:
    """Ctrl-C, as a user stops it; killed if it has not exited within a minute."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Served:
    inference: object
    server: object

    @property
    def url(self) -> str:
        return self.server.url


def start_served(**rollout) -> Served:
    from final.inf import InferenceEngine
    from final.server.app import ServerThread, create_app

    api_key = rollout.pop("api_key", None)
    # the tests' cartridge files live under the system temp folder (pytest's tmp_path)
    cartridge_dir = rollout.pop("cartridge_dir", tempfile.gettempdir())
    inference = InferenceEngine(tiny_config(**{"prompt_length": 256, "response_length": 32, **rollout}))
    try:
        return Served(inference, ServerThread(create_app(inference, api_key=api_key, cartridge_dir=cartridge_dir)))
    except BaseException:
        inference.shutdown()
        raise


def stop_served(served: Served) -> None:
    served.server.stop()
    served.inference.shutdown()


@pytest.fixture(scope="module")
def served():
    """A `final serve` of the tiny model for the test module (import this fixture into the module)."""
    s = start_served()
    yield s
    stop_served(s)


@pytest.fixture(scope="module")
def carts(served, tmp_path_factory) -> dict[str, Path]:
    return build_cartridge_files(served.inference, tmp_path_factory.mktemp("carts"))


def build_cartridge_files(inference, folder: Path) -> dict[str, Path]:
    """Cartridges of DOC_A and DOC_B (chat layout: the document as a system turn), saved as .pt files."""
    from final.cartridges.build import build_from_text, document_ids
    from final.cartridges.format import save_cartridge

    out = {}
    for name, doc in (("a", DOC_A), ("b", DOC_B)):
        cart = build_from_text(inference.engine, document_ids(inference.tokenizer, doc))
        out[name] = folder / f"doc_{name}.pt"
        save_cartridge(cart, out[name])
    return out


def spec(path: Path, force: bool = False) -> dict:
    return {"id": str(path), "source": "local", "force_redownload": force}


class FlakyServer:
    """A real HTTP server on 127.0.0.1: its first `failures` POSTs fail (`mode` "503", "400" or "drop": close the
    connection without answering); later requests are proxied to `upstream`. Modes "stale" and "stale-rst" are a
    keep-alive server closing an idle connection just as a request arrives on it (uvicorn's idle timeout racing the
    client): the first `failures` requests that come on a connection already used are read and the connection
    closed without a byte of answer (a FIN; an RST with "stale-rst"); `dropped` counts them. Answers relayed keep
    their status and Retry-After."""

    def __init__(self, upstream: str, failures: int, mode: str = "503"):
        self.upstream = upstream.rstrip("/")
        self.failures = failures
        self.mode = mode
        self.calls = self.dropped = 0
        self.relayed: list[int] = []  # the upstream's statuses, in the order relayed
        self._lock = threading.Lock()
        flaky = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def do_GET(self) -> None:
                self._relay(httpx.get(flaky.upstream + self.path, timeout=60))

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                reused, self.used = getattr(self, "used", False), True  # one handler per connection
                with flaky._lock:
                    n = flaky.calls
                    flaky.calls += 1
                    stale = flaky.mode.startswith("stale") and reused and flaky.dropped < flaky.failures
                    flaky.dropped += stale
                if stale:
                    self._close(rst=flaky.mode == "stale-rst")
                    return
                if n < flaky.failures and not flaky.mode.startswith("stale"):
                    if flaky.mode == "drop":
                        self._close(rst=False)
                        return
                    status = int(flaky.mode)
                    self._send(status, json.dumps({"error": {"message": f"injected failure {n}", "type": "x",
                                                             "param": None, "code": None}}).encode())
                    return
                resp = httpx.post(flaky.upstream + self.path, content=body, timeout=120,
                                  headers={"content-type": "application/json"})
                self._relay(resp)

            def _close(self, rst: bool) -> None:
                if rst:  # SO_LINGER 0: close() sends an RST, which the client reads as ECONNRESET
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()

            def _relay(self, resp: httpx.Response) -> None:
                with flaky._lock:
                    flaky.relayed.append(resp.status_code)
                self._send(resp.status_code, resp.content, resp.headers.get("retry-after"))

            def _send(self, status: int, content: bytes, retry_after: str | None = None) -> None:
                self.send_response(status)
                if retry_after is not None:
                    self.send_header("Retry-After", retry_after)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "FlakyServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
