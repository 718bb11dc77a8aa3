"""`final serve` and `final ping` as a user runs them: real processes, real sockets on 127.0.0.1."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx
import pytest

from final.process_group import free_port

CLI = [sys.executable, "-m", "final.cli"]


@pytest.fixture(scope="module")
def server():
    """`final serve --port 0` (any free port); the port is read from uvicorn's startup line."""
    proc = subprocess.Popen([*CLI, "serve", "--model", "builtin:tiny-random-llama", "--port", "0"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    url, seen = None, []
    for line in proc.stderr:
        seen.append(line)
        m = re.search(r"running on (http://127\.0\.0\.1:\d+)", line)
        if m:
            url = m.group(1)
            break
    if url is None:
        proc.kill()
        pytest.fail("final serve did not start:\n" + "".join(seen))
    yield url, proc
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0  # a clean shutdown on Ctrl+C


def ping(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "ping", *args], capture_output=True, text=True, timeout=120)


def test_serve_binds_localhost_and_answers(server):
    url, _ = server
    assert httpx.get(f"{url}/ping").json() == {"message": "pong"}
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "builtin:tiny-random-llama"


def test_ping_subcommand(server):
    url, _ = server
    res = ping("--url", url)
    assert res.returncode == 0 and "pong" in res.stdout
    text = ping("--url", url, "--max-tokens", "6", "Once upon a time")
    assert text.returncode == 0, text.stderr
    ref = httpx.post(f"{url}/v1/completions", json={"model": "x", "prompt": "Once upon a time", "max_tokens": 6,
                                                    "temperature": 0}).json()["choices"][0]["text"]
    assert text.stdout.rstrip("\n") == ref and "time taken" in text.stderr
    streamed = ping("--url", url, "--chat", "--stream", "--max-tokens", "6", "Hi there")
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "x", "max_tokens": 6, "temperature": 0,
                                                          "messages": [{"role": "user", "content": "Hi there"}]})
    assert streamed.returncode == 0 and streamed.stdout.rstrip("\n") == chat.json()["choices"][0]["message"]["content"]
    two = ping("--url", url, "--n", "2", "--temperature", "1", "--max-tokens", "3", "Hi")
    assert two.returncode == 0 and "--- [1]" in two.stdout


def test_ping_reports_errors(server):
    url, _ = server
    bad = ping("--url", url, "--cartridge", "/no/such/cartridge.pt", "Hi")
    # the CLI server has no --cartridge-dir: HTTP clients cannot make it read local files
    assert bad.returncode == 1 and "HTTP 400" in bad.stderr and "--cartridge-dir" in bad.stderr
    dead = ping("--url", f"http://127.0.0.1:{free_port()}", "Hi")
    assert dead.returncode == 1 and "cannot reach" in dead.stderr


def test_serve_with_a_bad_config_says_why(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("model_path: builtin:tiny-random-llama\nrollout:\n  prompt_lenght: 64\n")
    res = subprocess.run([*CLI, "serve", "--config", str(cfg), "--port", "0"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and "prompt_length" in res.stderr
