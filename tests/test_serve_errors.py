"""Bad requests get OpenAI-style 4xx JSON naming the field, and the server keeps answering (seed 004, tier 5)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from serve_helpers import start_served, stop_served

pytest_plugins = ["serve_helpers"]  # the served / carts fixtures


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.url, timeout=120) as c:
        yield c


def _error(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


CASES = [
    # (path, body, param)
    ("/v1/completions", {"model": "m", "prompt": ""}, "prompt"),                      # empty prompt
    ("/v1/completions", {"model": "m", "prompt": "   "}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": []}, "prompt"),                      # no tokens at all
    ("/v1/completions", {"model": "m", "prompt": [[]]}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": "word " * 400}, "prompt"),          # over prompt_length
    ("/v1/completions", {"model": "m", "prompt": [10**7]}, "prompt"),                # outside the vocabulary
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": "5"}, "max_tokens"),   # wrong types
    ("/v1/completions", {"model": "m", "prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "n": True}, "n"),
    ("/v1/completions", {"model": "m", "prompt": 42}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "logprobs": 21}, "logprobs"),  # over limits.max_top_logprobs
    ("/v1/completions", {"model": "m", "prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "echo": True, "stream": True}, "echo"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "echo": True, "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "made_up": 1}, "made_up"),    # unknown field
    ("/v1/completions", {"prompt": "hi"}, "model"),                                   # missing field
    ("/v1/completions", {"model": "m", "prompt": "hi", "cartridges": []}, "cartridges"),  # not on /v1
    ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user"}]}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                              "max_completion_tokens": 2}, "max_tokens"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 3}, "top_logprobs"),                   # without logprobs: true
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "yaml"}}, "response_format"),
    ("/custom/cartridge/completions",
     {"model": "m", "prompt": "hi", "cartridges": [{"id": "/nonexistent/cart.pt", "source": "local"}]}, "cartridges"),
    ("/custom/cartridge/completions", {"model": "m", "prompt": "hi",
                                       "cartridges": [{"id": "x", "source": "ftp"}]}, "cartridges.0.source"),
    ("/custom/cartridge/completions", {"model": "m", "prompt": "hi", "cartridges": [{"source": "local"}]},
     "cartridges.0.id"),
    ("/custom/cartridge/completions", {"model": "m", "prompt": "hi", "cartridges": "a.pt"}, "cartridges"),
    ("/generate", {"prompt": ""}, "prompt"),
]


@pytest.mark.parametrize("path,body,param", CASES, ids=[f"{c[0]}:{c[2]}:{i}" for i, c in enumerate(CASES)])
def test_bad_requests_are_400_naming_the_field(http, path, body, param):
    err = _error(http.post(path, json=body))
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"


def test_bad_json_and_wrong_body_types(http):
    for content in (b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe"):
        err = _error(http.post("/v1/completions", content=content, headers={"content-type": "application/json"}))
        assert err["code"] in ("invalid_json", "invalid_request")
    _error(http.post("/v1/chat/completions", content=b"null"))


def test_unknown_routes_and_methods(http):
    assert _error(http.get("/v1/nothing"), 404)["code"] == "not_found"
    assert _error(http.get("/v1/completions"), 405)["code"] == "method_not_allowed"


def test_a_one_token_prompt_is_fine(http):
    """The shortest valid prompt is answered; only an empty one is refused."""
    out = http.post("/v1/completions", json={"model": "m", "prompt": [1], "max_tokens": 3, "temperature": 0})
    assert out.status_code == 200 and out.json()["usage"]["prompt_tokens"] == 1


def test_server_survives_all_of_it(served, http):
    for path, body, _ in CASES:
        http.post(path, json=body)
    # a client that hangs up mid-request and one that sends half a body
    for raw in (b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                b'Content-Length: 100\r\n\r\n{"model": "m", ',):
        with socket.create_connection(("127.0.0.1", served.server.port)) as sock:
            sock.sendall(raw)
    assert http.get("/ping").json() == {"message": "pong"}
    ok = http.post("/v1/completions", json={"model": "m", "prompt": "still here?", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None


@pytest.fixture(scope="module")
def long_served():
    s = start_served(response_length=2048)  # long generations, so a client can hang up mid-way
    yield s
    stop_served(s)


def _wait_for(predicate, tries: int = 600) -> bool:
    for _ in range(tries):
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_hanging_up_aborts_the_request(long_served):
    """A client that goes away frees its row: the engine aborts the request instead of finishing it."""
    engine = long_served.inference.engine
    before = engine.stats.aborted
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
    with httpx.Client(base_url=long_served.url, timeout=60) as c:  # streaming: read one event, hang up
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert next(r.iter_lines()).startswith("data: ")
    assert _wait_for(lambda: engine.stats.aborted == before + 1)
    started = engine.stats.requests
    payload = json.dumps(body).encode()  # not streaming: send the request, hang up without reading
    with socket.create_connection(("127.0.0.1", long_served.server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        assert _wait_for(lambda: engine.stats.requests > started)
    assert _wait_for(lambda: engine.stats.aborted == before + 2)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert httpx.get(f"{long_served.url}/ping").json() == {"message": "pong"}
