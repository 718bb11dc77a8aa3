"""HTTP with retries, as every client of the protocol uses it (the tokasaurus backend and final.client).

- Connection errors, timeouts, dropped connections and 5xx answers are retried with exponential backoff.
- Back-pressure: 429 (and 503) answers are retried after the server's `Retry-After` (seconds or an HTTP date;
  without it, the backoff), each wait stretched by a random fraction up to `RetryPolicy.jitter` so clients refused
  together do not come back together. When the policy's retries are spent, a 429 gives up with OverloadedError
  (its `retry_after` the server's last), anything else with BackendUnavailableError saying what failed.
- Any other 4xx is the request's own fault and is raised at once as RequestRejectedError (its `param` names the
  field, read from an OpenAI-style `{"error": {...}}` body or FastAPI's `{"detail": ...}`).
- Stale keep-alive connections: a server closes a connection it has kept idle (uvicorn after 5 s), and a request
  sent on it at that moment fails before any byte of an answer. Clients made here expire idle connections sooner
  (KEEPALIVE_EXPIRY_S), and a request that failed that way on a reused connection is sent again at once on a new
  one, without counting as a retry (as Go's net/http transport does). Every request these clients send may be sent
  twice: completions change nothing on the server, and loading the same weights file again leaves the same
  weights (the version counts the update twice).
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from final.errors import BackendUnavailableError, FinalError, OverloadedError

logger = logging.getLogger("final.client")

# uvicorn (final serve, Tokasaurus) closes a connection idle for 5 s; httpx keeps one for 5 s: expire it well before
KEEPALIVE_EXPIRY_S = 2.0
BUSY = (429, 503)  # the server asks the client to come back later (Retry-After)


class RequestRejectedError(FinalError, ValueError):
    """The server answered 4xx: the request itself is wrong, so it is not retried. `param` names the field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        self.status, self.param, self.code = status, param, code
        super().__init__(f"HTTP {status}{f' (param {param!r})' if param else ''}: {message}")


class _Retryable(Exception):
    """A 5xx or 429 answer: the server may recover. `retry_after`: the server's Retry-After in seconds."""

    def __init__(self, message: str, status: int, retry_after: float | None = None):
        self.status, self.retry_after = status, retry_after
        super().__init__(message)


@dataclass
class RetryPolicy:
    max_retries: int = 3          # retries after the first attempt (connection errors, timeouts, 5xx, 429)
    starting_delay: float = 1.0   # seconds before the first retry
    backoff_factor: float = 2.0
    max_delay: float = 60.0       # the longest wait, Retry-After included
    jitter: float = 0.2           # each wait is stretched by a random fraction in [0, jitter)

    def delay(self, retry: int, retry_after: float | None = None) -> float:
        """The wait before retry `retry` (0-based): the server's Retry-After if it sent one, else the backoff;
        at most max_delay, then stretched by the jitter (never shorter than the server asked)."""
        base = retry_after if retry_after is not None else self.starting_delay * self.backoff_factor ** retry
        return min(base, self.max_delay) * (1.0 + self.jitter * random.random())


def client(timeout: float, headers: dict | None = None) -> httpx.Client:
    """A blocking client whose idle connections expire before the server's (see the module doc)."""
    return httpx.Client(timeout=timeout, headers=headers, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S))


def async_client(timeout: float, max_connections: int | None = None) -> httpx.AsyncClient:
    """An awaitable client whose idle connections expire before the server's (see the module doc)."""
    limits = httpx.Limits(max_connections=max_connections, keepalive_expiry=KEEPALIVE_EXPIRY_S)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


def retry_after(resp: httpx.Response) -> float | None:
    """The answer's Retry-After in seconds (a number or an HTTP date), None when absent or unreadable."""
    value = resp.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time()) if when is not None else None


def _checked(resp: httpx.Response) -> dict:
    if resp.status_code >= 500 or resp.status_code == 429:
        raise _Retryable(f"HTTP {resp.status_code}: {resp.text[:300]}", resp.status_code,
                         retry_after(resp) if resp.status_code in BUSY else None)
    if resp.status_code >= 400:
        try:
            body = resp.json()
        except ValueError:
            body = {}
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):  # OpenAI-style ({"error": {...}}), as final serve answers
            raise RequestRejectedError(resp.status_code, str(err.get("message")), err.get("param"), err.get("code"))
        detail = body.get("detail") if isinstance(body, dict) else None  # FastAPI's, as Tokasaurus answers
        raise RequestRejectedError(resp.status_code, str(detail if detail is not None else resp.text[:300]))
    return resp.json()


_TRANSIENT = (httpx.TransportError, _Retryable)  # connect/read errors, timeouts, dropped connections, 5xx, 429
_STALE = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)  # a closed connection, seen by a request


class _Attempt:
    """One request's httpcore trace: whether it opened a connection and whether any answer came back."""

    def __init__(self) -> None:
        self.connected = self.answered = False

    def see(self, name: str) -> None:
        if name.startswith("connection.connect_tcp"):
            self.connected = True
        elif name == "http11.receive_response_headers.complete":
            self.answered = True

    def stale(self, exc: BaseException) -> bool:
        """The request failed on a reused connection before any byte of an answer: the server had closed it."""
        return isinstance(exc, _STALE) and not self.connected and not self.answered

    def trace(self, name: str, info: dict) -> None:
        self.see(name)

    async def atrace(self, name: str, info: dict) -> None:
        self.see(name)


def _gave_up(method: str, url: str, attempts: int, exc: BaseException) -> FinalError:
    if isinstance(exc, _Retryable) and exc.status == 429:
        return OverloadedError(f"{method} {url}: the server was still busy (HTTP 429) after {attempts} attempt(s), "
                               f"each after its Retry-After; raise the client's max_retries to wait longer. Last "
                               f"answer: {exc}", exc.retry_after or 1.0)
    return BackendUnavailableError(f"{method} {url} failed after {attempts} attempt(s); last error: "
                                   f"{type(exc).__name__}: {exc}. Is the server running and healthy?")


def _retry_delay(method: str, url: str, retry: int, exc: BaseException, policy: RetryPolicy) -> float:
    """The wait before the next attempt, or the typed error when the policy is spent (the one rule of
    request_json and arequest_json)."""
    if retry == policy.max_retries:
        raise _gave_up(method, url, retry + 1, exc) from exc
    delay = policy.delay(retry, getattr(exc, "retry_after", None))
    logger.warning("%s %s failed (%s: %s); retry %d/%d in %.2fs", method, url, type(exc).__name__, exc, retry + 1,
                   policy.max_retries, delay)
    return delay


def request_json(http: httpx.Client, method: str, url: str, payload: Any, policy: RetryPolicy) -> dict:
    """A JSON request with retries (blocking); payload None sends no body."""
    for retry in range(policy.max_retries + 1):
        try:
            return _checked(_send(http, method, url, payload))
        except _TRANSIENT as exc:
            time.sleep(_retry_delay(method, url, retry, exc, policy))
    raise AssertionError("unreachable")


def _send(http: httpx.Client, method: str, url: str, payload: Any, **kwargs: Any) -> httpx.Response:
    attempt = _Attempt()
    body = {} if payload is None else {"json": payload}
    try:
        return http.request(method, url, extensions={"trace": attempt.trace}, **body, **kwargs)
    except _STALE as exc:
        if not attempt.stale(exc):
            raise
        logger.debug("%s %s: the server had closed the pooled connection; sending again", method, url)
        return http.request(method, url, **body, **kwargs)


async def _asend(http: httpx.AsyncClient, method: str, url: str, payload: Any, **kwargs: Any) -> httpx.Response:
    attempt = _Attempt()
    body = {} if payload is None else {"json": payload}
    try:
        return await http.request(method, url, extensions={"trace": attempt.atrace}, **body, **kwargs)
    except _STALE as exc:
        if not attempt.stale(exc):
            raise
        logger.debug("%s %s: the server had closed the pooled connection; sending again", method, url)
        return await http.request(method, url, **body, **kwargs)


def post_json(http: httpx.Client, url: str, payload: dict, policy: RetryPolicy) -> dict:
    """POST with retries (blocking)."""
    return request_json(http, "POST", url, payload, policy)


async def apost_json(http: httpx.AsyncClient, url: str, payload: dict, policy: RetryPolicy,
                     timeout_growth: float = 1.0) -> dict:
    """POST with retries (awaitable). Attempt i waits up to the client's timeout * timeout_growth**i."""
    for retry in range(policy.max_retries + 1):
        try:
            timeout = http.timeout
            if timeout.read is not None:  # waiting for a pooled connection is not the server's slowness
                timeout = httpx.Timeout(timeout.read * timeout_growth ** retry, pool=None)
            return _checked(await _asend(http, "POST", url, payload, timeout=timeout))
        except _TRANSIENT as exc:
            await asyncio.sleep(_retry_delay("POST", url, retry, exc, policy))
    raise AssertionError("unreachable")
