"""What `final serve` bounds before a request reaches InferenceEngine, and how it stops.

- The body: at most limits.max_body_bytes (413, refused from Content-Length before reading, else while reading, so
  a huge body is never held in memory) and JSON when a content type is given (415: a form post from `curl -d`).
- Shutdown: on SIGTERM the server drains (DrainingServer): new requests get 503 with `Connection: close` while
  the requests in flight finish, within a grace period; then it exits 0. `Drain` is the ASGI middleware that
  counts them and answers the 503s.
Rows queued in the engine are bounded by InferenceEngine itself (final/admission.py: 429 with Retry-After).
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import threading
import time
from typing import Any, Iterator

import uvicorn
from fastapi import Request

from final.server.errors import APIError

_JSON_TYPES = ("application/json", "text/json")


async def read_body(raw: Request, max_bytes: int) -> bytes:
    """The request body, refusing one past max_bytes (413) or of a type that is not JSON (415)."""
    declared = raw.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    kind = raw.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind and kind not in _JSON_TYPES and not kind.endswith("+json"):
        raise APIError(415, f"the request body must be JSON (Content-Type: application/json), got {kind!r}",
                       param="content-type", code="unsupported_media_type")
    chunks, size = [], 0
    async for chunk in raw.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, max_bytes: int) -> APIError:
    return APIError(413, f"request body of {size}+ bytes exceeds limits.max_body_bytes={max_bytes}",
                    code="request_too_large")


class Drain:
    """ASGI middleware: counts HTTP requests in flight (a stream until its last byte) and, once `start()` is
    called, answers new ones 503 so a load balancer moves on while the old ones finish."""

    def __init__(self, app: Any):
        self.app = app
        self.in_flight = 0
        self.draining = False

    def start(self) -> None:
        self.draining = True

    @property
    def idle(self) -> bool:
        return self.in_flight == 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining:
            await _shutting_down(send)
            return
        self.in_flight += 1  # one event loop: no lock needed
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


async def _shutting_down(send: Any) -> None:
    err = APIError(503, "the server is shutting down; retry on another server", code="shutting_down")
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """uvicorn, stopping gently. On the first SIGTERM or SIGINT new requests get 503 (Drain) and the server stops
    once those in flight have finished or `grace` seconds have passed (what is left is then cut, its rows
    aborted); a second signal stops at once. The process exits 0: uvicorn itself re-raises the signal after
    shutting down, which would end the process with the signal's status and skip the engine's shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Drain, grace: float):
        super().__init__(config)
        self.drain, self.grace, self.until = drain, grace, math.inf

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.drain.draining:
            self.should_exit = self.force_exit = True
            return
        print(f"final serve: draining ({self.drain.in_flight} requests in flight, {self.grace:g} s grace)",
              file=sys.stderr)
        self.drain.start()
        self.until = time.monotonic() + self.grace

    async def on_tick(self, counter: int) -> bool:
        if self.drain.draining and (self.drain.idle or time.monotonic() >= self.until):
            self.should_exit = True
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
