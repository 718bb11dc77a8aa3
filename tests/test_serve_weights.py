"""`final serve`'s weight updates over HTTP (SGLang's POST /update_weights_from_disk, GET /get_weight_version):
refused (403) unless the server was started with --weights-dir; with it, a trained HF folder under that folder
makes the server answer as the trained model; the tokasaurus backend and final.client drive it."""

from __future__ import annotations

import httpx
import pytest

from conftest import TINY, tiny_config
from serve_helpers import spawn_serve, stop_serve
from weights_helpers import hf_greedy, perturbed, save_policy

MAX = 10


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory):
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def server(weights_root):
    from final.inf import InferenceEngine
    from final.server.app import ServerThread, create_app

    with InferenceEngine(tiny_config(prompt_length=128, response_length=16)) as inference:
        with ServerThread(create_app(inference, weights_dir=str(weights_root))) as thread:
            yield inference, thread.url


def completion_ids(url: str, ids: list[int]) -> list[int]:
    from final.protocol.fingerprint import read_fingerprint

    body = {"model": "m", "prompt": ids, "max_tokens": MAX, "temperature": 0.0, "logprobs_in_fingerprint": True}
    r = httpx.post(f"{url}/custom/cartridge/completions", json=body, timeout=60)
    r.raise_for_status()
    return read_fingerprint(r.json()["system_fingerprint"])[0][0]


def test_updates_are_refused_unless_the_server_was_given_a_weights_folder(tiny_dir):
    from final.inf import InferenceEngine
    from final.server.app import ServerThread, create_app

    with InferenceEngine(tiny_config()) as inference, ServerThread(create_app(inference)) as thread:
        r = httpx.post(f"{thread.url}/update_weights_from_disk", json={"model_path": tiny_dir}, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "weight_updates_disabled"
        assert httpx.get(f"{thread.url}/get_weight_version").json() == {"weight_version": 0}


def test_a_trained_folder_makes_the_server_answer_as_that_model(server, tiny_dir, weights_root):
    inference, url = server
    ids = [1, 22, 333, 44]
    before = completion_ids(url, ids)
    policy = perturbed(tiny_dir, scale=0.5, seed=11)
    save_policy(policy, tiny_dir, weights_root / "step1")
    r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": "step1"}, timeout=60)
    assert r.status_code == 200, r.text
    version = r.json()["weights_version"]
    assert r.json()["success"] is True and version == inference.weights_version
    after = completion_ids(url, ids)
    assert after != before and after == hf_greedy(policy, [ids], MAX)[0]
    body = {"model": "m", "prompt": "hello", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["weights_version"] == version
    assert httpx.get(f"{url}/get_weight_version").json() == {"weight_version": version}


@pytest.mark.parametrize("body, status, code", [
    ({"model_path": "../../etc"}, 403, "weights_path_refused"),
    ({"model_path": "/"}, 403, "weights_path_refused"),
    ({"model_path": "missing"}, 400, "invalid_request"),
    ({"model_path": "a\x00b"}, 400, "invalid_request"),
    ({"model_path": "step1", "abort_all_requests": True}, 400, "unsupported_parameter"),
    ({"model_path": "step1", "load_format": "pt"}, 400, "invalid_request"),
    ({"model_path": 3}, 400, "invalid_request"),
    ({"path": "step1"}, 400, "invalid_request"),
])
def test_bad_requests_are_4xx_and_never_echo_the_servers_paths(server, weights_root, body, status, code):
    _, url = server
    r = httpx.post(f"{url}/update_weights_from_disk", json=body, timeout=30)
    assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    assert str(weights_root) not in r.text


def test_a_bad_weights_file_is_refused_naming_the_parameter_and_nothing_changes(server, tiny_dir, weights_root):
    import torch

    from final.weights import save_weights

    inference, url = server
    ids = [1, 5, 6]
    before, version = completion_ids(url, ids), inference.weights_version
    policy = perturbed(tiny_dir, scale=0.5, seed=12)
    named = list(policy.state_dict().items())
    named[5] = (named[5][0], torch.zeros(2, 2))
    save_weights(named, weights_root / "bad.safetensors")
    r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": "bad.safetensors"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_weights"
    assert named[5][0] in r.json()["error"]["message"]
    assert completion_ids(url, ids) == before and inference.weights_version == version


def test_the_tokasaurus_backend_and_the_client_update_the_server(server, tiny_dir, weights_root):
    from final.client import TokasaurusClient
    from final.errors import UnsupportedError, WeightsError
    from final.inf import InferenceEngine

    inference, url = server
    cfg = tiny_config(prompt_length=128, response_length=16)
    cfg["rollout"].update(name="tokasaurus", custom={"tokasaurus_url": url, "max_retries": 0,
                                                     "weights_dir": str(weights_root / "staging")})
    policy = perturbed(tiny_dir, scale=0.5, seed=13)
    with InferenceEngine(cfg) as toka:
        start = inference.weights_version
        assert toka.update_weights(policy) == 1 and inference.weights_version == start + 1  # tensors, via a file
        ids = toka.prepare(["hello"]).ids
        assert toka.generate(["hello"], temperature=0, max_tokens=MAX).token_ids == hf_greedy(policy, ids, MAX)
        with pytest.raises(WeightsError, match="model.norm.weight"):
            toka.update_weights({"model.norm.weight": __import__("torch").zeros(3)})
        folder = save_policy(perturbed(tiny_dir, scale=0.5, seed=14), tiny_dir, weights_root / "step2")
        assert toka.update_weights(folder) == 2  # a path goes to the server as it is
        assert inference.weights_version == start + 2
    cfg["rollout"]["custom"].pop("weights_dir")
    with InferenceEngine(cfg) as toka, pytest.raises(UnsupportedError, match="weights_dir"):
        toka.update_weights(policy)
    with TokasaurusClient({"model": "toka:m", "base_url": url, "max_retries": 0}) as client:
        assert client.update_weights_from_disk("step1") == start + 3 == client.weights_version()


def test_final_serve_takes_the_weights_dir_flag(tiny_dir, tmp_path):
    policy = perturbed(tiny_dir, scale=0.5, seed=15)
    save_policy(policy, tiny_dir, tmp_path / "w" / "p")
    url, proc = spawn_serve("--model", TINY, "--weights-dir", str(tmp_path / "w"))
    try:
        r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": "p"}, timeout=120)
        assert r.status_code == 200 and r.json()["weights_version"] == 1, r.text
        assert completion_ids(url, [1, 7, 8]) == hf_greedy(policy, [[1, 7, 8]], MAX)[0]
    finally:
        stop_serve(proc)
