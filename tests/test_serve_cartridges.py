"""Tokasaurus' cartridge endpoints on `final serve`: the cartridge stands for its document, each request gets only
its own cartridges (seed 004 tiers 2-3), and the fingerprint carries token ids and logprobs."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_helpers import DOC_A, spec
from final.protocol.fingerprint import read_fingerprint

pytest_plugins = ["serve_helpers"]  # the served / carts fixtures

Q = "Who keeps the lighthouse?"


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.url, timeout=120) as c:
        yield c


def chat(http, question, cartridges=None, path=None, **kw):
    body = {"model": "m", "messages": [{"role": "user", "content": question}], "max_tokens": 12, "temperature": 0,
            **kw}
    if cartridges is not None:
        body["cartridges"] = cartridges
    r = http.post(path or ("/custom/cartridge/chat/completions" if cartridges is not None else "/v1/chat/completions"),
                  json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_cartridge_stands_for_the_document(http, carts):
    with_cart = chat(http, Q, [spec(carts["a"])])
    in_prompt = http.post("/v1/chat/completions", json={
        "model": "m", "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "system", "content": DOC_A}, {"role": "user", "content": Q}]}).json()
    assert with_cart["choices"][0]["message"]["content"] == in_prompt["choices"][0]["message"]["content"]
    ids_cart, _ = read_fingerprint(with_cart["system_fingerprint"])
    ids_doc, _ = read_fingerprint(in_prompt["system_fingerprint"])
    assert ids_cart == ids_doc
    # the document was not prefilled: its tokens are reported as cached
    cached = with_cart["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 20 and with_cart["usage"]["prompt_tokens"] == in_prompt["usage"]["prompt_tokens"]


def test_completions_endpoint_with_token_ids_and_fingerprint_logprobs(served, http, carts):
    q_ids = served.inference.tokenizer(" The keeper is", add_special_tokens=False)["input_ids"]
    body = {"model": "default", "prompt": q_ids, "max_tokens": 8, "temperature": 0, "logprobs_in_fingerprint": True,
            "cartridges": [spec(carts["a"])]}
    out = http.post("/custom/cartridge/completions", json=body).json()
    ids, logprobs = read_fingerprint(out["system_fingerprint"])
    ref = served.inference.engine.generate(q_ids, {"max_new_tokens": 8, "temperature": 0}, return_logprob=True,
                                           cartridges=(str(carts["a"]),))
    assert ids == [ref["output_ids"]]
    assert logprobs[0] == pytest.approx([lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]], abs=1e-5)
    # the older route names of Tokasaurus' branches answer the same
    assert http.post("/v1/cartridge/completions", json=body).json()["choices"][0]["text"] == out["choices"][0]["text"]


def test_two_cartridges_dispatched_per_request_without_cross_contamination(http, carts):
    a, b = spec(carts["a"]), spec(carts["b"])
    jobs = [("Who keeps the lighthouse?", [a]), ("When does the creek flood?", [b]), ("Hello!", []),
            ("Who keeps the lighthouse?", [b]), ("When does the creek flood?", [a]), ("Hello!", [a, b])] * 3
    alone = [chat(http, q, c)["choices"][0]["message"]["content"] for q, c in jobs[:6]] * 3
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: chat(http, *job)["choices"][0]["message"]["content"], jobs))
    assert together == alone
    assert alone[0] != alone[3] and alone[1] != alone[4]  # A and B really differ for the same question


def _refcounts(served) -> dict[str, int]:
    store = served.inference.cartridges.store
    return {cid: store.get(cid).refcount for cid in store.ids()}


def test_streaming_on_the_cartridge_endpoint(served, http, carts):
    whole = chat(http, Q, [spec(carts["b"])])["choices"][0]["message"]["content"]
    text = ""
    with http.stream("POST", "/custom/cartridge/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": Q}], "max_tokens": 12, "temperature": 0,
            "stream": True, "cartridges": [spec(carts["b"])]}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
    assert text == whole
    # the stream held its cartridge while it ran and released it when it ended, even when cut short
    with http.stream("POST", "/custom/cartridge/completions", json={
            "model": "m", "prompt": "Once", "max_tokens": 30, "ignore_eos": True, "stream": True,
            "cartridges": [spec(carts["a"]), spec(carts["b"])]}) as r:
        next(r.iter_lines())
    for _ in range(200):
        if not any(_refcounts(served).values()):
            break
        http.get("/ping")
    assert set(_refcounts(served).values()) == {0}


def test_loaded_cartridges_by_id_and_force_redownload(served, http, carts, tmp_path):
    served.inference.load_cartridge(id="lighthouse", path=str(carts["a"]))
    try:  # a resident id needs no source (Tokasaurus' default source, wandb, is never contacted)
        assert chat(http, Q, [{"id": "lighthouse"}])["choices"][0]["message"]["content"] == \
            chat(http, Q, [spec(carts["a"])])["choices"][0]["message"]["content"]
    finally:
        served.inference.unload_cartridge("lighthouse")
    moving = tmp_path / "training.pt"
    shutil.copy(carts["a"], moving)
    first = chat(http, Q, [spec(moving)])["choices"][0]["message"]["content"]
    shutil.copy(carts["b"], moving)  # a training step wrote a new cartridge to the same path
    assert chat(http, Q, [spec(moving)])["choices"][0]["message"]["content"] == first  # cached copy
    reloaded = chat(http, Q, [spec(moving, force=True)])["choices"][0]["message"]["content"]
    assert reloaded == chat(http, Q, [spec(carts["b"])])["choices"][0]["message"]["content"] != first


def test_seed_001_generate_endpoint(http, carts):
    """/generate is a chat turn with an optional system message, answered as {text, finish_reason, usage}."""
    plain = http.post("/generate", json={"model": "m", "system": "Be brief.", "prompt": Q, "max_tokens": 6,
                                         "temperature": 0}).json()
    ref_sys = http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 6, "temperature": 0, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": Q}]}).json()
    assert plain["text"] == ref_sys["choices"][0]["message"]["content"]
    assert plain["usage"]["completion_tokens"] == ref_sys["usage"]["completion_tokens"]
    with_cart = http.post("/generate", json={"prompt": Q, "max_tokens": 6, "temperature": 0,
                                             "cartridges": [spec(carts["a"])]}).json()
    assert with_cart["text"] == chat(http, Q, [spec(carts["a"])], max_tokens=6)["choices"][0]["message"]["content"]


def test_unknown_cartridge_then_still_serving(http, carts):
    bad = http.post("/custom/cartridge/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": Q}], "max_tokens": 4,
        "cartridges": [{"id": str(carts["a"].parent / "no-such-cartridge.pt"), "source": "local"}]})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_cartridge"
    assert "does not exist" in bad.json()["error"]["message"]
    assert chat(http, Q, [spec(carts["a"])])["choices"]
    assert http.get("/ping").json() == {"message": "pong"}


@pytest.mark.parametrize("cid", ["/etc/passwd", "{tmp}/../../etc/passwd", "../../../etc/hostname"])
def test_local_files_outside_the_cartridge_dir_are_refused(http, carts, cid):
    import tempfile

    bad = http.post("/custom/cartridge/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": Q}], "max_tokens": 4,
        "cartridges": [{"id": cid.format(tmp=tempfile.gettempdir()), "source": "local"}]})
    assert bad.status_code == 400 and "outside the server's --cartridge-dir" in bad.json()["error"]["message"]
    assert http.get("/ping").json() == {"message": "pong"}


def test_without_a_cartridge_dir_only_loaded_ids_are_served(carts):
    from serve_helpers import start_served, stop_served

    served = start_served(cartridge_dir=None)
    try:
        cid = served.inference.load_cartridge(path=str(carts["a"]))  # the operator loads it
        with httpx.Client(base_url=served.url, timeout=120) as c:
            ok = c.post("/custom/cartridge/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": Q}], "max_tokens": 4,
                "cartridges": [{"id": cid, "source": "local"}]})
            assert ok.status_code == 200, ok.text
            refused = c.post("/custom/cartridge/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": Q}], "max_tokens": 4,
                "cartridges": [{"id": str(carts["b"]), "source": "local"}]})
            assert refused.status_code == 400 and "--cartridge-dir" in refused.json()["error"]["message"]
    finally:
        stop_served(served)
