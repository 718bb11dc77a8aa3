"""No file state under --cartridge-dir makes `final serve` answer 5xx or show a path of its disk (issue 43 item 4).

Before: a file the server may not read, or one that vanished between the lookup and the read, raised PermissionError /
FileNotFoundError from `open` -> HTTP 500 whose message held the file's absolute path; a --cartridge-dir longer than
1,024 bytes made every id under it "too long" (the id limit was applied to the server's own joined path); loads
while plain prompts streamed are checked here too.

One real `final serve` of the tiny model runs for the module under a --cartridge-dir ~1,100 bytes long. Running as
root, the server runs under `setpriv` without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH, so a mode-000 file is as
unreadable to it as to any user (root reads everything otherwise)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import sys
from pathlib import Path

import httpx
import pytest
import torch

from conftest import TINY, tiny_config
from final.cartridges.format import CartridgeKV, save_cartridge
from final.cartridges.manifest import CartridgeManifest, ModelShape
from final.inf import InferenceEngine
from final.models import resolve_model_path
from final.server.app import ServerThread, create_app
from serve_helpers import spawn_serve, stop_serve

ROUTE = "/custom/cartridge/completions"
DROP_READ_ANY = ("setpriv", "--bounding-set=-dac_override,-dac_read_search",
                 "--inh-caps=-dac_override,-dac_read_search")


def _cart(tokens: int = 4) -> CartridgeKV:
    shape = ModelShape.of(resolve_model_path(TINY))
    kv = (1, shape.num_kv_heads, tokens, shape.head_dim)
    return CartridgeKV([torch.randn(kv).bfloat16() for _ in range(shape.num_layers)],
                       [torch.randn(kv).bfloat16() for _ in range(shape.num_layers)], 1)


def _prefix() -> tuple[str, ...]:
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a mode-000 file cannot be made unreadable to the server")
    return DROP_READ_ANY


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("files")
    carts = root.joinpath(*["d" * 200] * 5, "carts")  # ~1,100 bytes: past the 1,024 an id may have
    assert len(str(carts).encode()) > 1024
    save_cartridge(_cart(), carts / "good.pt")
    for i in range(6):
        save_cartridge(_cart(), carts / f"copy{i}.pt")
    locked = save_cartridge(_cart(), carts / "locked.pt")
    locked.chmod(0)
    with_manifest = save_cartridge(_cart(), carts / "manifested.pt")
    manifest = CartridgeManifest.describe(_cart(), with_manifest, cartridge_id="manifested.pt").write(with_manifest)
    manifest.chmod(0)
    hidden = carts / "hidden"
    save_cartridge(_cart(), hidden / "inner.pt")
    save_cartridge(_cart(), hidden / "cartridge.pt")
    hidden.chmod(0)
    yield {"root": root, "carts": carts}
    hidden.chmod(0o755)


@pytest.fixture(scope="module")
def http(layout):
    url, proc = spawn_serve("--model", TINY, "--cartridge-dir", str(layout["carts"]), prefix=_prefix())
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            yield client
    finally:
        stop_serve(proc)


def _body(cid: str, prompt: str = "hi") -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "cartridges": [{"id": cid, "source": "local"}]}


def _no_server_path(text: str, layout: dict[str, Path]) -> None:
    for path in (str(layout["root"]), os.path.realpath(layout["root"]), sys.prefix, os.path.expanduser("~"),
                 os.getcwd(), "d" * 200):
        assert path not in text, (path[:80], text[:400])


def test_a_cartridge_dir_longer_than_an_id_serves_its_files(http):
    r = http.post(ROUTE, json=_body("good.pt"))
    assert r.status_code == 200, r.text[:400]


@pytest.mark.parametrize("cid", ["locked.pt", "manifested.pt", "hidden/inner.pt", "hidden", "hidden/cartridge.pt"])
def test_an_unreadable_file_is_a_400_naming_the_id(http, layout, cid):
    r = http.post(ROUTE, json=_body(cid))
    assert r.status_code == 400, r.text[:400]
    err = r.json()["error"]
    assert err["code"] == "invalid_cartridge" and cid in err["message"], err
    _no_server_path(r.text, layout)
    assert http.post(ROUTE, json=_body("good.pt")).status_code == 200  # serving on


@pytest.mark.parametrize("cid", ["missing.pt", "../outside.pt", "/etc/passwd", "hidden/../../x.pt"])
def test_refusals_show_no_server_path(http, layout, cid):
    r = http.post(ROUTE, json=_body(cid))
    assert r.status_code == 400, r.text[:400]
    _no_server_path(r.text, layout)


def test_loads_while_plain_prompts_stream(http, layout):
    """Six loads (each a new file) race streamed plain completions: every answer is a 200, every stream ends
    cleanly (an error after the start arrives as a data: {"error"} event)."""
    def stream(i: int) -> str:
        body = {"model": "m", "prompt": f"count {i}", "max_tokens": 8, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            return "".join(r.iter_text())

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(stream, i) for i in range(6)]
        loads = [pool.submit(http.post, ROUTE, json=_body(f"copy{i}.pt")) for i in range(6)]
        for f in loads:
            assert f.result().status_code == 200, f.result().text[:300]
        for f in streams:
            events = [json.loads(e[6:]) for e in f.result().split("\n\n") if e.startswith("data: {")]
            assert events and not any("error" in e for e in events), events[-1:]


def test_a_file_vanishing_before_the_read_is_a_400(tmp_path, monkeypatch):
    """The race between the lookup and the read, made certain: the file is gone when `open` runs (as when another
    process replaces a cartridge). The server answers 400 naming the id, not 500 with the path."""
    import final.cartridges.format as fmt

    carts = tmp_path / "carts"
    save_cartridge(_cart(), carts / "going.pt")

    def gone(path, *a, **k):
        raise FileNotFoundError(2, "No such file or directory", str(path))

    monkeypatch.setattr(fmt, "open", gone, raising=False)
    with InferenceEngine(tiny_config()) as inference, \
            ServerThread(create_app(inference, cartridge_dir=str(carts))) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post(ROUTE, json=_body("going.pt"))
        assert r.status_code == 400 and "going.pt" in r.json()["error"]["message"], r.text[:400]
        assert str(tmp_path) not in r.text
        monkeypatch.undo()
        assert client.post(ROUTE, json=_body("going.pt")).status_code == 200
