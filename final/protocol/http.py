"""POST with retries, as both clients of the protocol use it (the tokasaurus backend and final.client).

Connection errors, timeouts, dropped connections and 5xx answers are retried with exponential backoff; a 4xx
answer is the request's own fault and is raised at once as RequestRejectedError (its `param` names the field,
read from an OpenAI-style `{"error": {...}}` body or FastAPI's `{"detail": ...}`). After the last retry
BackendUnavailableError says what failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx

from final.errors import BackendUnavailableError, FinalError

logger = logging.getLogger("final.client")


class RequestRejectedError(FinalError, ValueError):
    """The server answered 4xx: the request itself is wrong, so it is not retried. `param` names the field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        self.status, self.param, self.code = status, param, code
        super().__init__(f"HTTP {status}{f' (param {param!r})' if param else ''}: {message}")


class _Retryable(Exception):
    """A 5xx answer: the server may recover."""


@dataclass
class RetryPolicy:
    max_retries: int = 3          # retries after the first attempt
    starting_delay: float = 1.0   # seconds before the first retry
    backoff_factor: float = 2.0
    max_delay: float = 60.0

    def delay(self, retry: int) -> float:
        return min(self.starting_delay * self.backoff_factor ** retry, self.max_delay)


def _checked(resp: httpx.Response) -> dict:
    if resp.status_code >= 500:
        raise _Retryable(f"HTTP {resp.status_code}: {resp.text[:300]}")
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


_TRANSIENT = (httpx.TransportError, _Retryable)  # connect/read errors, timeouts, dropped connections, 5xx


def _gave_up(url: str, attempts: int, exc: BaseException) -> BackendUnavailableError:
    return BackendUnavailableError(f"POST {url} failed after {attempts} attempt(s); last error: "
                                   f"{type(exc).__name__}: {exc}. Is the server running and healthy?")


def _retry_delay(url: str, retry: int, exc: BaseException, policy: RetryPolicy) -> float:
    """The wait before the next attempt, or BackendUnavailableError when the policy is spent (the one rule of
    both post_json and apost_json)."""
    if retry == policy.max_retries:
        raise _gave_up(url, retry + 1, exc) from exc
    delay = policy.delay(retry)
    logger.warning("POST %s failed (%s: %s); retry %d/%d in %.2fs", url, type(exc).__name__, exc, retry + 1,
                   policy.max_retries, delay)
    return delay


def post_json(http: httpx.Client, url: str, payload: dict, policy: RetryPolicy) -> dict:
    """POST with retries (blocking)."""
    for retry in range(policy.max_retries + 1):
        try:
            return _checked(http.post(url, json=payload))
        except _TRANSIENT as exc:
            time.sleep(_retry_delay(url, retry, exc, policy))
    raise AssertionError("unreachable")


async def apost_json(http: httpx.AsyncClient, url: str, payload: dict, policy: RetryPolicy,
                     timeout_growth: float = 1.0) -> dict:
    """POST with retries (awaitable). Attempt i waits up to the client's timeout * timeout_growth**i."""
    for retry in range(policy.max_retries + 1):
        try:
            timeout = http.timeout
            if timeout.read is not None:  # waiting for a pooled connection is not the server's slowness
                timeout = httpx.Timeout(timeout.read * timeout_growth ** retry, pool=None)
            return _checked(await http.post(url, json=payload, timeout=timeout))
        except _TRANSIENT as exc:
            await asyncio.sleep(_retry_delay(url, retry, exc, policy))
    raise AssertionError("unreachable")
