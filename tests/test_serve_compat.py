"""`final serve` with real cartridges of every cartridges-repo version and Tokasaurus' request forms (issue 19):
HF's logprobs over HTTP under both position conventions, Tokasaurus' local ids and <cartridge> system blocks,
remote sources refused unless the server allows them, and an unreachable hub answered with a typed error within
the configured bound while the server goes on serving."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest
import torch

from compat_helpers import JUNE_CONFIG, LATER_CONFIG, reference, save_repo_file, write_run
from final.cartridges.sources import sanitize_cartridge_id
from serve_helpers import start_served, stop_served

TOKA_ID = "team/doc.v1"  # a Tokasaurus local id: ./cartridges/team-doc_v1/{cartridge.pt,config.yaml}


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.fixture(scope="module")
def served(ref, tmp_path_factory):
    folder = tmp_path_factory.mktemp("cartridge_dir")
    write_run(folder / "june", ref["keys"], ref["values"], layout="june", config=JUNE_CONFIG)
    write_run(folder / "later", ref["keys"], ref["values"], layout="later", config=LATER_CONFIG)
    toka = folder / sanitize_cartridge_id(TOKA_ID)
    save_repo_file(ref["keys"], ref["values"], toka / "cartridge.pt", layout="later")
    (toka / "config.yaml").write_text(json.dumps(LATER_CONFIG))
    s = start_served(cartridge_dir=str(folder), prompt_length=128, dtype="float32")
    yield s
    stop_served(s)


def post(served, path, body):
    return httpx.post(served.url + path, json={"model": "tiny", **body}, timeout=120)


def echo_logprobs(served, cartridge: dict) -> list[float]:
    r = post(served, "/custom/cartridge/completions", {"prompt": served.cont, "max_tokens": 0, "echo": True,
                                                       "logprobs": 1, "cartridges": [cartridge]})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["token_logprobs"][1:]


@pytest.mark.parametrize("cid,positions", [("june/cache_last.pt", "after_prefix"), ("later", "from_zero"),
                                           (TOKA_ID, "from_zero")])
def test_repo_cartridges_over_http_give_hf_logprobs(served, ref, cid, positions):
    served.cont = ref["cont"]
    assert echo_logprobs(served, {"id": cid, "source": "local"}) == pytest.approx(ref[positions], abs=2e-4)


def test_request_sets_the_convention(served, ref):
    served.cont = ref["cont"]
    spec = {"id": "june/cache_last.pt", "source": "local", "force_redownload": True, "positions": "from_zero"}
    assert echo_logprobs(served, spec) == pytest.approx(ref["from_zero"], abs=2e-4)
    r = post(served, "/custom/cartridge/completions", {"prompt": "hi", "cartridges": [{**spec, "positions": "up"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cartridges.0.positions"


def test_cartridge_block_in_a_system_message(served):
    question = {"role": "user", "content": "Who keeps the lighthouse?"}
    block = f'<cartridge>\n{{"id": "{TOKA_ID}", "source": "local"}}\n</cartridge>'
    greedy = {"temperature": 0, "max_tokens": 8}
    by_block = post(served, "/v1/chat/completions", {"messages": [{"role": "system", "content": block}, question],
                                                     **greedy})
    assert by_block.status_code == 200, by_block.text
    by_field = post(served, "/custom/cartridge/chat/completions",
                    {"messages": [question], "cartridges": [{"id": TOKA_ID, "source": "local"}], **greedy})
    plain = post(served, "/v1/chat/completions", {"messages": [question], **greedy})
    text = by_block.json()["choices"][0]["message"]["content"]
    assert text == by_field.json()["choices"][0]["message"]["content"]
    assert text != plain.json()["choices"][0]["message"]["content"]
    assert by_block.json()["usage"]["prompt_tokens"] == by_field.json()["usage"]["prompt_tokens"]
    # the rest of the system message stays, as Tokasaurus keeps it
    kept = post(served, "/custom/cartridge/chat/completions",
                {"messages": [{"role": "system", "content": f"Be brief.\n\n{block}\n\n\n"}, question], **greedy})
    assert kept.status_code == 200 and kept.json()["usage"]["prompt_tokens"] > by_block.json()["usage"]["prompt_tokens"]
    bad = post(served, "/v1/chat/completions",
               {"messages": [{"role": "system", "content": '<cartridge>{"id": 3}</cartridge>'}, question]})
    assert bad.status_code == 400 and "messages[0].content" in bad.json()["error"]["message"]
    both = post(served, "/custom/cartridge/chat/completions",
                {"messages": [{"role": "system", "content": block}, question],
                 "cartridges": [{"id": TOKA_ID, "source": "local"}]})
    assert both.status_code == 400 and "not both" in both.json()["error"]["message"]


@pytest.mark.parametrize("source,cid", [("huggingface", "org/doc"), ("s3", "s3://bucket/doc.pt"), ("wandb", "abc123")])
def test_remote_sources_are_refused_unless_allowed(served, source, cid):
    r = post(served, "/custom/cartridge/completions", {"prompt": "hi", "cartridges": [{"id": cid, "source": source}]})
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == "cartridge_source_disabled" and "--cartridge-sources" in err["message"]
    assert cid in err["message"] and source in err["message"]
    assert post(served, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_failing_source_is_a_502_naming_it(served, monkeypatch):
    """S3 at a closed 127.0.0.1 port (one attempt): the download fails at once, 502 with the cartridge and source."""
    pytest.importorskip("boto3")
    from final.server.app import ServerThread, create_app

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[1]
    for key, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{dead}", "AWS_MAX_ATTEMPTS": "1",
                       "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    with ServerThread(create_app(served.inference, cartridge_sources=("local", "s3"))) as server:
        r = httpx.post(server.url + "/custom/cartridge/completions", timeout=120,
                       json={"model": "tiny", "prompt": "hi", "cartridges": [{"id": "s3://b/doc.pt", "source": "s3"}]})
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["code"] == "cartridge_source_unreachable" and "s3://b/doc.pt" in err["message"]
        assert "source s3" in err["message"]


def _random_kv():
    g = torch.Generator().manual_seed(3)  # the tiny model's shape: 2 layers, 2 KV heads, head_dim 16
    return ([torch.randn(1, 2, 6, 16, generator=g) for _ in range(2)],
            [torch.randn(1, 2, 6, 16, generator=g) for _ in range(2)])


# ---- an unreachable hub: a real `final serve` process whose HF_ENDPOINT is a 127.0.0.1 port that hangs or drops ---
class FakeHub:
    """Accepts connections on 127.0.0.1 and, per `mode`, holds them open without a word ("hang") or closes them
    at once ("drop"). `connected` is set when the first connection arrives."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.mode = "hang"
        self.connected = threading.Event()
        self.held: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connected.set()
            if self.mode == "hang":
                self.held.append(conn)
            else:
                conn.close()

    def close(self):
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    hub = FakeHub()
    folder = tmp_path_factory.mktemp("serve")
    cart = save_repo_file(*_random_kv(), folder / "doc.pt", layout="june")  # resident from the start
    cfg = folder / "config.yaml"
    cfg.write_text("model_path: builtin:tiny-random-llama\nprogress: false\n"
                   "rollout: {name: local, prompt_length: 64, response_length: 8}\n"
                   f"cartridges: [{{id: doc, source: local, path: {cart}}}]\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{hub.port}", HF_HUB_ETAG_TIMEOUT="30", HF_HUB_DOWNLOAD_TIMEOUT="30")
    proc = subprocess.Popen([sys.executable, "-m", "final.cli", "serve", "--config", str(cfg), "--port", "0",
                             "--cartridge-sources", "local,hf", "--cartridge-fetch-timeout", "3"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    url, seen = None, []
    for line in proc.stderr:
        seen.append(line)
        if m := re.search(r"running on (http://127\.0\.0\.1:\d+)", line):
            url = m.group(1)
            break
    if url is None:
        proc.kill()
        proc.wait()
        pytest.fail("final serve did not start:\n" + "".join(seen))
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # keep the pipe drained
    yield url, hub
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    hub.close()


def test_unreachable_hub_is_a_typed_error_and_blocks_no_one(remote):
    url, hub = remote
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2,
            "cartridges": [{"id": "org/hanging-doc", "source": "huggingface"}]}
    answer = {}
    waiting = threading.Thread(target=lambda: answer.setdefault(
        "r", httpx.post(url + "/custom/cartridge/completions", json=body, timeout=120)))
    waiting.start()
    assert hub.connected.wait(60)  # the download is under way, held by the hub
    other = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=120)
    assert other.status_code == 200
    resident = httpx.post(url + "/custom/cartridge/completions", timeout=120, json={
        "model": "tiny", "prompt": "hi", "max_tokens": 2, "cartridges": [{"id": "doc", "source": "local"}]})
    assert resident.status_code == 200, resident.text
    assert "r" not in answer  # both served while the cartridge's download still hangs
    waiting.join(120)
    r = answer["r"]
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "cartridge_source_timeout"
    assert "org/hanging-doc" in err["message"] and "huggingface" in err["message"]
    # still serving
    assert httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                      timeout=120).status_code == 200
