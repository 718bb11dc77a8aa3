"""The HTTP clients (final.client and the tokasaurus backend) against a real `final serve` whose queue holds one row
(limits.max_queued_rows: 1): a keep-alive connection the server closed while idle never fails a request, and a
busy server's 429 is waited out after its Retry-After (with jitter), then given up with a typed error.

The stale connection is reproduced deterministically: FlakyServer (a real keep-alive HTTP server in front of the
real one) closes a used connection when the next request arrives on it, as uvicorn does when its 5 s idle timeout
fires just as the client sends; the clients' idle expiry is raised past the test so the connection is reused.
The full queue is held by the test itself (one row admitted and not finished), so no timing decides who gets 429.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

import pytest

import final.protocol.http as http
from conftest import tiny_config
from serve_helpers import FlakyServer, Served, stop_served
from final.client import get_lm_client
from final.errors import OverloadedError
from final.inf import InferenceEngine
from final.protocol.http import RetryPolicy, retry_after

SYSTEM, USER = "You are terse.", "Name a prime."


@pytest.fixture(scope="module")
def served():
    from final.server.app import ServerThread, create_app

    inference = InferenceEngine({**tiny_config(prompt_length=256, response_length=32),
                                 "limits": {"max_queued_rows": 1}})
    s = Served(inference, ServerThread(create_app(inference)))
    yield s
    stop_served(s)


@pytest.fixture
def long_keepalive(monkeypatch):
    """Clients made in the test keep idle connections for a minute, so the second request reuses the first's."""
    monkeypatch.setattr(http, "KEEPALIVE_EXPIRY_S", 60.0)


def lm(url: str, **cfg):
    return get_lm_client({"model": "toka:default", "base_url": url, "temperature": 0.0, "max_output_tokens": 6,
                          "starting_delay": 0.01, **cfg})


def toka_engine(url: str, **custom) -> InferenceEngine:
    cfg = tiny_config(prompt_length=256, response_length=32)
    cfg["rollout"].update(name="tokasaurus", custom={"tokasaurus_url": url, "retry_delay": 0.01, **custom})
    return InferenceEngine(cfg)


def reference(served) -> str:
    return served.inference.generate([[{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]],
                                     temperature=0, max_tokens=6).completions[0]


@pytest.mark.parametrize("mode", ["stale", "stale-rst"])
def test_a_connection_the_server_closed_while_idle_is_reused_without_failing(served, long_keepalive, mode):
    """max_retries=0: nothing would retry a failed request, yet the second call on the closed connection answers."""
    want = reference(served)
    with FlakyServer(served.url, failures=1, mode=mode) as flaky:
        client = lm(flaky.url, max_retries=0)
        assert [client.call(SYSTEM, USER) for _ in range(3)] == [want] * 3
        client.close()
        assert flaky.dropped == 1 and flaky.calls == 4  # the dropped request really was sent on a used connection
    prompts = ["What is 2+2?", "Name a color."]
    ids = [served.inference.generate(p, temperature=0, max_tokens=6).token_ids[0] for p in prompts]
    with FlakyServer(served.url, failures=1, mode=mode) as flaky, toka_engine(flaky.url, max_retries=0) as eng:
        for _ in range(3):  # rows one at a time: a single pooled connection, reused
            assert [eng.generate(p, temperature=0, max_tokens=6).token_ids[0] for p in prompts] == ids
        assert flaky.dropped == 1


def test_a_dropped_request_on_a_new_connection_still_counts_as_a_failure(served):
    """Only a reused connection is replayed at once: a server that drops a fresh connection is a failure."""
    from final.errors import BackendUnavailableError

    with FlakyServer(served.url, failures=1, mode="drop") as flaky:
        with pytest.raises(BackendUnavailableError, match=r"after 1 attempt\(s\)"):
            lm(flaky.url, max_retries=0).call(SYSTEM, USER)
        assert flaky.calls == 1


@contextlib.contextmanager
def queue_full(served) -> Iterator[None]:
    """One row admitted and not finished: the one-row queue is full until the block ends."""
    with served.inference._admission.hold(1):
        yield


class _Retries(logging.Handler):
    """Counts the clients' retry warnings and their waits; `first` is set at the first one."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.waits: list[float] = []
        self.first = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "retry" in record.getMessage():
            self.waits.append(record.args[-1])
            self.first.set()


@pytest.fixture
def retries() -> Iterator[_Retries]:
    handler = _Retries()
    logger = logging.getLogger("final.client")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def test_a_full_queue_is_waited_out_after_retry_after(served, retries):
    want = reference(served)
    with queue_full(served):
        call = _in_thread(lambda: lm(served.url, max_retries=5).call(SYSTEM, USER))
        assert retries.first.wait(120)  # the server answered 429; the client waits its Retry-After
    assert call() == want
    assert retries.waits and min(retries.waits) >= 1.0  # final serve's Retry-After is 1 s; the backoff is 0.01 s


def test_a_queue_that_stays_full_is_a_typed_error_after_the_policy_limit(served, retries):
    with queue_full(served):
        with pytest.raises(OverloadedError, match=r"HTTP 429\) after 2 attempt\(s\)") as err:
            lm(served.url, max_retries=1).call(SYSTEM, USER)
    assert err.value.retry_after >= 1.0 and len(retries.waits) == 1
    assert lm(served.url, max_retries=0).call(SYSTEM, USER) == reference(served)  # served again once it drains


def test_the_tokasaurus_backend_waits_out_a_full_queue_then_gives_up_typed(served, retries):
    want = served.inference.generate("What is 2+2?", temperature=0, max_tokens=6).token_ids
    with toka_engine(served.url, max_retries=4) as eng:
        with queue_full(served):
            call = _in_thread(lambda: eng.generate("What is 2+2?", temperature=0, max_tokens=6))
            assert retries.first.wait(120)
        assert call().token_ids == want
    with toka_engine(served.url, max_retries=1) as eng, queue_full(served):
        with pytest.raises(OverloadedError, match="HTTP 429"):
            eng.generate("What is 2+2?", temperature=0, max_tokens=6)


def test_retry_policy_waits():
    policy = RetryPolicy(max_retries=3, starting_delay=0.5, backoff_factor=2.0, max_delay=10.0, jitter=0.2)
    for retry, base in ((0, 0.5), (1, 1.0), (2, 2.0), (6, 10.0)):
        waits = [policy.delay(retry) for _ in range(200)]
        assert base <= min(waits) and max(waits) < base * 1.2 and len(set(waits)) > 1  # stretched, never shortened
    assert 3.0 <= policy.delay(0, retry_after=3.0) < 3.6  # the server's Retry-After replaces the backoff
    assert 10.0 <= policy.delay(0, retry_after=3600) < 12.0  # capped at max_delay
    assert RetryPolicy(jitter=0.0).delay(1) == 2.0


def test_retry_after_reads_seconds_and_http_dates():
    import email.utils
    import time

    import httpx

    def answer(value):
        return httpx.Response(429, headers={} if value is None else {"Retry-After": value})

    assert retry_after(answer("3")) == 3.0 and retry_after(answer("0.5")) == 0.5
    assert retry_after(answer(None)) is None and retry_after(answer("soon")) is None
    assert retry_after(answer("-4")) == 0.0
    later = email.utils.formatdate(time.time() + 120, usegmt=True)
    assert 100 < retry_after(answer(later)) <= 120
    assert retry_after(answer(email.utils.formatdate(time.time() - 60, usegmt=True))) == 0.0


def _in_thread(fn):
    """Start fn on a thread; returns a function that waits for its result (or raises its error)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result():
        thread.join(300)
        assert not thread.is_alive(), "the call did not finish"
        if "error" in box:
            raise box["error"]
        return box["value"]

    return result
