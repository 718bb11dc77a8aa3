"""Bounded work per request (issue 13): the limits of the config (and `final serve`'s flags) hold for Python and
HTTP alike, the queue is bounded (429 with Retry-After), bodies are bounded (413), a deadline aborts a request's
rows (504), a client that hangs up frees its rows, and SIGTERM drains `final serve` and exits 0. Nothing here
asserts on time: progress is read from the engine's own counters."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
import yaml

from conftest import sleeps_until_cancelled, tiny_config
from final.calls import until_deadline, within_deadline
from final.errors import CartridgeError, ConfigError, DeadlineError, OverloadedError, PromptError, SamplingError
from final.inf import InferenceEngine
from final.server.app import ServerThread, create_app

LIMITS = {"max_n": 64, "max_queued_rows": 64, "max_body_bytes": 262144}
LONG = 256  # response_length: a cut request would have run for 64 x 256 tokens


@pytest.fixture(scope="module")
def inference():
    eng = InferenceEngine({**tiny_config(prompt_length=64, response_length=LONG, max_num_seqs=8), "limits": LIMITS})
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(inference):
    with ServerThread(create_app(inference)) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _stats(inference):
    """The engine's counters, read on its own thread."""
    return inference.engine.call(lambda _r: dict(vars(inference.engine.core.stats)))


def _until(condition, what: str, limit: float = 120.0) -> None:
    """Poll for a state the engine reaches by itself; the limit only keeps a broken run from hanging."""
    end = time.monotonic() + limit
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"never saw: {what}")
        time.sleep(0.01)


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


GOOD = {"model": "m", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}


# ---- the three defects, over HTTP and from Python -------------------------------------------------------
def test_found_nan_temperature_is_refused_everywhere(inference, http):
    """`{"temperature": NaN}` as Python's json sends it: 400 naming the field; generate() a SamplingError."""
    body = json.dumps({**GOOD, "temperature": float("nan")})
    err = _error(http.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400)
    assert err["param"] == "temperature" and "finite" in err["message"]
    for field in ("top_p", "presence_penalty", "min_p", "repetition_penalty"):
        body = json.dumps({**GOOD, field: float("inf")})
        assert _error(http.post("/v1/completions", content=body), 400)["param"] == field
    with pytest.raises(SamplingError, match="temperature.*finite"):
        inference.generate("hi", temperature=float("nan"))
    assert http.post("/v1/completions", json=GOOD).status_code == 200


def test_found_n_and_stop_lists_are_bounded(inference, http):
    assert "limits.max_n=64" in _error(http.post("/v1/completions", json={**GOOD, "n": 100000}), 400)["message"]
    err = _error(http.post("/v1/completions", json={**GOOD, "stop": [f"s{i}" for i in range(10000)]}), 400)
    assert err["param"] == "stop" and "limits.max_stop=16" in err["message"]
    with pytest.raises(SamplingError, match="limits.max_n"):
        inference.generate("hi", n=10**6)
    with pytest.raises(SamplingError, match="limits.max_stop_length"):
        inference.generate("hi", stop=["x" * 300])


def test_a_huge_body_is_a_413_before_it_is_read(http):
    """Fails on main: a 100k-stop-string body was read and parsed whole (400 after the work, no size bound)."""
    huge = json.dumps({**GOOD, "stop": ["stop"] * 100000}).encode()
    err = _error(http.post("/v1/completions", content=huge, headers={"content-type": "application/json"}), 413)
    assert err["code"] == "request_too_large" and "limits.max_body_bytes=262144" in err["message"]

    def chunks():  # no Content-Length: counted while reading
        for _ in range(80):
            yield b" " * 4096

    assert _error(http.post("/v1/completions", content=chunks()), 413)["code"] == "request_too_large"
    assert http.post("/v1/completions", json=GOOD).status_code == 200


def test_a_body_that_is_not_json_is_a_415(http):
    form = http.post("/v1/completions", data={"model": "m", "prompt": "hi"})  # what `curl -d` sends
    assert _error(form, 415)["param"] == "content-type"
    assert _error(http.post("/v1/completions", content=b"hi", headers={"content-type": "text/plain"}), 415)
    ok = http.post("/v1/completions", content=json.dumps(GOOD), headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_python_api_limits_are_typed(inference):
    with pytest.raises(SamplingError, match="max_queued_rows=64"):
        inference.generate(["a", "b"], n=33)  # 66 rows could never be admitted
    small = InferenceEngine({**tiny_config(), "limits": {"max_prompts": 2, "max_stop": 1}})
    try:
        with pytest.raises(PromptError, match="limits.max_prompts=2"):
            small.generate(["a", "b", "c"])
        with pytest.raises(SamplingError, match="limits.max_stop=1"):
            small.generate("a", stop=["x", "y"])
    finally:
        small.shutdown()
    with pytest.raises(ConfigError, match="limits.max_queued_rows"):
        InferenceEngine({**tiny_config(), "limits": {"max_queued_rows": 0}})


# ---- admission control and hang-ups ------------------------------------------------------------------------------
def _raw_post(url: str, body: dict) -> socket.socket:
    """Send a request on a bare socket (so the test can hang up mid-way, as a client that dies)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_full_queue_is_429_and_a_cut_request_frees_its_rows(inference, server, http):
    """Fails on main (no admission control: the second request queued behind 64 x 256 tokens). A client that hangs
    up frees all 64 of its rows at once, and the next request is answered without waiting for them."""
    before = _stats(inference)
    big = {**GOOD, "n": 64, "max_tokens": LONG, "ignore_eos": True, "temperature": 1.0}
    sock = _raw_post(server.url, big)
    _until(lambda: _stats(inference)["requests"] >= before["requests"] + 64, "the n=64 request admitted")
    full = http.post("/v1/completions", json=GOOD)
    assert _error(full, 429)["code"] == "engine_overloaded" and full.headers["retry-after"] == "1"
    sock.close()  # the client dies
    _until(lambda: _stats(inference)["aborted"] >= before["aborted"] + 64, "all 64 rows aborted")
    answered = http.post("/v1/completions", json=GOOD)
    assert answered.status_code == 200
    done = _stats(inference)
    assert done["generated_tokens"] - before["generated_tokens"] < 64 * LONG // 2  # far from the cut one's work
    assert inference.engine.call(lambda _r: len(inference.engine.core.scheduler.waiting)) == 0


def test_a_cut_stream_with_n_samples_frees_its_rows(inference, server, http):
    before = _stats(inference)
    big = {**GOOD, "n": 32, "max_tokens": LONG, "ignore_eos": True, "temperature": 1.0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=120) as client, client.stream("POST", "/v1/completions",
                                                                                 json=big) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())  # the stream has started, then the client goes away
    _until(lambda: _stats(inference)["aborted"] >= before["aborted"] + 32, "all 32 streamed rows aborted")
    assert http.post("/v1/completions", json=GOOD).status_code == 200
    assert _stats(inference)["generated_tokens"] - before["generated_tokens"] < 32 * LONG // 2


def test_admission_from_python(inference):
    async def scenario():
        hog = asyncio.ensure_future(inference.agenerate(["x"] * 8, n=8, max_tokens=LONG, ignore_eos=True))
        while inference._admission.rows < 64:
            await asyncio.sleep(0.01)
        with pytest.raises(OverloadedError, match="max_queued_rows=64"):
            await inference.agenerate("y", max_tokens=2)
        hog.cancel()
        await asyncio.gather(hog, return_exceptions=True)
        return await inference.agenerate("y", max_tokens=2)

    assert asyncio.run(scenario()).metadata[0]["completion_tokens"] == 2
    assert inference._admission.rows == 0


# ---- deadlines ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hasty():
    """Requests get 0.3 s: long ones cannot finish, short ones do."""
    eng = InferenceEngine({**tiny_config(prompt_length=64, response_length=4000), "limits": {"deadline_s": 0.3}})
    yield eng
    eng.shutdown()


def test_a_deadline_aborts_the_rows(hasty):
    long = {"max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(DeadlineError, match="0.3 s"):
        hasty.generate("hi", **long)
    with pytest.raises(DeadlineError):
        asyncio.run(hasty.agenerate("hi", n=4, **long))
    _until(lambda: not hasty.engine.call(lambda _r: hasty.engine.core.scheduler.has_work()), "the engine idle")
    assert hasty.generate("hi", max_tokens=2).metadata[0]["completion_tokens"] == 2


def test_a_deadline_is_told_from_the_works_own_timeout():
    """The deadline is read from the task's state, not the clock (asyncio fires timers up to a clock tick early:
    a clock comparison once turned an expired deadline into the work's "own" TimeoutError, a 500 in CI)."""
    cancelled = []

    def slow():
        return sleeps_until_cancelled(cancelled)

    async def own_timeout():
        raise TimeoutError("a tool's own")

    async def scenario():
        with pytest.raises(DeadlineError):
            await within_deadline(slow(), 0.01)
        assert cancelled == [True]  # the work was aborted before the error reached us
        with pytest.raises(TimeoutError, match="a tool's own"):
            await within_deadline(own_timeout(), 60)
        caller = asyncio.ensure_future(within_deadline(slow(), 60))
        await asyncio.sleep(0.01)
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        assert cancelled == [True, True]  # a cancelled caller cancels its work
        assert await within_deadline(asyncio.sleep(0, "done"), 60) == "done"

        async def stream(last):  # a stream's updates: two items, then `last` (never ends, or its own timeout)
            yield 1
            yield 2
            await last()

        with pytest.raises(DeadlineError):
            assert [x async for x in until_deadline(stream(slow), 0.05)] == "unreachable"
        assert cancelled == [True, True, True]
        got = []
        with pytest.raises(TimeoutError, match="a tool's own"):
            async for x in until_deadline(stream(own_timeout), 60):
                got.append(x)
        assert got == [1, 2]

    asyncio.run(scenario())


def test_a_deadline_over_http_is_504_or_an_error_event(hasty):
    with ServerThread(create_app(hasty)) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        body = {**GOOD, "max_tokens": 4000, "ignore_eos": True}
        assert _error(http.post("/v1/completions", json=body), 504)["code"] == "deadline_exceeded"
        stream = http.post("/v1/completions", json={**body, "stream": True})
        events = [json.loads(x[6:]) for x in stream.text.split("\n\n") if x.startswith("data: {")]
        assert events[-1]["error"]["code"] == "deadline_exceeded" and stream.text.endswith("data: [DONE]\n\n")
        assert http.post("/v1/completions", json=GOOD).status_code == 200


# ---- final serve: flags and SIGTERM ------------------------------------------------------------------------------
def test_sigterm_drains_and_exits_0(tmp_path):
    """A real `final serve`: its limit flags apply; after SIGTERM new requests get 503 while the stream in
    flight runs to its end; then the process exits 0."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(prompt_length=64, response_length=3000)))
    proc = subprocess.Popen([sys.executable, "-m", "final.cli", "serve", "--config", str(config), "--port", "0",
                             "--max-n", "2", "--max-grammar-bytes", "64", "--grace", "300", "--log-level", "info"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        url = _server_url(proc)
        with httpx.Client(base_url=url, timeout=120) as http:
            assert "limits.max_n=2" in _error(http.post("/v1/completions", json={**GOOD, "n": 3}), 400)["message"]
            too_big = http.post("/v1/completions", json={**GOOD, "regex": "a" * 100})
            assert "limits.max_grammar_bytes=64" in _error(too_big, 400)["message"]
            lines: list[str] = []
            started = threading.Event()
            body = {**GOOD, "max_tokens": 3000, "ignore_eos": True, "stream": True}

            def stream() -> None:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
                    for line in resp.iter_lines():
                        if line:
                            lines.append(line)
                            started.set()

            reader = threading.Thread(target=stream)
            reader.start()
            assert started.wait(120)
            proc.send_signal(signal.SIGTERM)
            _until(lambda: _status(url) == 503, "503 for new requests while draining")
            refused = httpx.post(f"{url}/v1/completions", json=GOOD, timeout=30)
            in_flight_then = "data: [DONE]" not in lines
            assert _error(refused, 503)["code"] == "shutting_down"
            reader.join(timeout=300)
        assert proc.wait(timeout=120) == 0
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert in_flight_then  # the stream was still running while new requests were refused ...
        assert events[-1]["choices"][0]["finish_reason"] == "length"  # ... and it ran to its end
        assert sum(len(e["choices"][0]["text"]) > 0 for e in events) > 1 and lines[-1] == "data: [DONE]"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _server_url(proc: subprocess.Popen) -> str:
    seen = []
    for line in proc.stderr:
        seen.append(line)
        m = re.search(r"running on (http://127\.0\.0\.1:\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # keep draining it
            return m.group(1)
    pytest.fail("final serve did not start:\n" + "".join(seen))


def _status(url: str) -> int:
    try:
        return httpx.get(f"{url}/ping", timeout=30).status_code
    except httpx.HTTPError:
        return 0


# ---- loaded cartridges -------------------------------------------------------------------------------------------
def _cart_file(inference, path, seed: int):
    from final.cartridges.format import CartridgeKV, save_cartridge

    spec, g = inference.engine.spec, torch.Generator().manual_seed(seed)
    shape = (1, spec.num_kv_heads, 8, spec.head_dim)
    keys = [torch.randn(shape, generator=g) for _ in range(spec.num_layers)]
    return save_cartridge(CartridgeKV(keys, [k.clone() for k in keys], 1), path), sum(k.numel() * 8 for k in keys)


def test_the_cartridge_budget_evicts_unused_ones_and_refs_go_back_to_zero(tmp_path):
    """limits.max_cartridge_bytes: request-loaded cartridges cannot pile up; /custom/cartridges shows the store."""
    probe = InferenceEngine(tiny_config())
    try:
        files = [_cart_file(probe, tmp_path / f"c{i}.pt", i) for i in range(3)]
    finally:
        probe.shutdown()
    one = files[0][1]
    eng = InferenceEngine({**tiny_config(), "limits": {"max_cartridge_bytes": 2 * one}})
    try:
        with ServerThread(create_app(eng, cartridge_dir=str(tmp_path))) as server, \
                httpx.Client(base_url=server.url, timeout=120) as http:
            for path, _ in files + files[:1]:
                body = {**GOOD, "cartridges": [{"id": path.name, "source": "local"}]}
                assert http.post("/custom/cartridge/completions", json=body).status_code == 200
            usage = http.get("/custom/cartridges").json()
            assert [c["id"] for c in usage["cartridges"]] == ["c2.pt", "c0.pt"]  # c1 was least recently used
            assert all(c["refcount"] == 0 for c in usage["cartridges"]) and usage["metrics"]["evictions"] == 2
    finally:
        eng.shutdown()
    with pytest.raises(ConfigError, match="limits.max_cartridge_bytes"):
        InferenceEngine({**tiny_config(), "limits": {"max_cartridge_bytes": -1}})


def test_a_resident_cartridge_is_never_read_from_its_id_as_a_path(tmp_path):
    """The server checks which ids are loaded, then the call loads what is not. A file under --cartridge-dir goes
    on with its path even when resident (evicted in between, it is reloaded from the folder); a loaded id from
    elsewhere goes on as a bare id (evicted in between: unknown id), never as a path the server would read."""
    from final.protocol.bodies import CartridgeCompletionsRequest
    from final.server.prepare import cartridge_specs

    def req(cid: str):
        return CartridgeCompletionsRequest(model="m", prompt="hi", cartridges=[{"id": cid, "source": "local"}])

    inside = tmp_path / "a.pt"
    assert cartridge_specs(req("a.pt"), ["a.pt"], tmp_path)[0]["path"] == str(inside)
    assert cartridge_specs(req("/data/doc.pt"), ["/data/doc.pt"], tmp_path) == ["/data/doc.pt"]
    assert cartridge_specs(req("/data/doc.pt"), ["/data/doc.pt"], None) == ["/data/doc.pt"]
    for cid, folder, words in (("/data/doc.pt", tmp_path, "outside"), ("b.pt", None, "--cartridge-dir"),
                               ("../b.pt", tmp_path, "outside")):
        with pytest.raises(CartridgeError, match=words):
            cartridge_specs(req(cid), [], folder)


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_a_stream_closed_between_updates_closes_cleanly_and_frees_its_rows(inference, how):
    """A stream left at a yield (the caller stopped reading: a hang-up, or a deadline that expired while the caller
    was busy, which throws CancelledError in right there) closes without an error and aborts its rows. Its
    engine streams were once closed while the merge was still reading them: "asynchronous generator is already
    running" instead of a clean close (the deadline test saw it as a stream ending in a generic error)."""
    before = _stats(inference)
    request = inference.prepare(["Hi", "Name a color."], max_tokens=LONG, ignore_eos=True, n=2, temperature=1.0)

    async def main():
        updates = inference.rollout.astream(request.dataproto(inference.pad_token_id, inference.eos_token_ids, None),
                                            **request.sampling.params)
        await updates.__anext__()  # streaming; the generator now waits at its yield
        if how == "aclose":
            await updates.aclose()
        else:  # what wait_for does when the time left is 0: cancel a step that has not started
            step = asyncio.ensure_future(updates.__anext__())
            step.cancel()
            with pytest.raises(asyncio.CancelledError):
                await step
            await updates.aclose()

    asyncio.run(main())
    _until(lambda: _stats(inference)["aborted"] >= before["aborted"] + 4, "all 4 streamed rows aborted")
    assert inference.generate("Hi", max_tokens=2).completions
