"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status.

Every failure of a request becomes one of these; none takes the server down. Bad input (our typed errors,
pydantic validation, malformed JSON) is a 400 naming the offending field; a body past limits.max_body_bytes 413,
a body that is not JSON 415; a cartridge source the server does not allow 403, one that fails 502 or does not
answer within limits.cartridge_fetch_s 504; a full queue 429 with Retry-After; a row the engine aborted 500; a request past its
deadline 504; an engine that cannot serve (shut down, shutting down) 503.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

from pydantic import ValidationError

from final.errors import (BackendUnavailableError, CartridgeError, CartridgeSourceError, ConfigError, DeadlineError,
                          EngineError, FinalError, OverloadedError, PromptError, SamplingError, SequenceError,
                          ToolsError, UnsupportedError)
from final.models import cache_dir

# The engine's SGLang names -> the request's OpenAI names, so `param` names what the client sent.
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "stop_token_ids": "stop", "top_logprobs_num": "top_logprobs",
                "cartridge": "cartridges", "prompt_logprobs": "echo"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):  # noqa: A002 - OpenAI's name
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def body(self, redact: Callable[[str], str] | None = None) -> dict[str, Any]:
        message = redact(self.message) if redact is not None else self.message
        return {"error": {"message": message, "type": self.type, "param": self.param, "code": self.code}}


class Redactor:
    """The server's own folders out of every error body (a cartridge's or weights' absolute path, an OSError's
    file name, a traceback's venv): a client reads a file under --cartridge-dir / --weights-dir by the name it
    sent, relative to that folder, and the server's other folders as <server>. Longest folder first, so
    --cartridge-dir under the working folder stays relative rather than becoming <server>/..."""

    def __init__(self, relative: Iterable[Path | str | None], hidden: Iterable[Path | str | None] = ()):
        roots = [(str(p), "") for p in relative if p] + [(str(p), "<server>") for p in hidden if p]
        roots += [(os.path.realpath(r), kind) for r, kind in roots]
        self._roots = sorted({r.rstrip("/"): kind for r, kind in roots if len(r.rstrip("/")) > 1}.items(),
                             key=lambda item: -len(item[0]))

    def __call__(self, text: str) -> str:
        for root, kind in self._roots:
            # the folder itself, or a path below it, where it starts a path (not inside a longer name)
            pattern = re.escape(root) + r"(/|(?![\w.-]))"
            text = re.sub(r"(?<![\w.-])" + pattern, lambda m: (kind + m.group(1)) if kind else
                          ("" if m.group(1) == "/" else "."), text)
        return text

    @classmethod
    def for_server(cls, cartridge_dir: Path | str | None, weights_dir: Path | str | None = None,
                   model_path: str | None = None) -> "Redactor":
        home = os.path.expanduser("~")
        model = model_path if model_path and os.path.isabs(model_path) else None
        return cls([cartridge_dir, weights_dir], [model, cache_dir(), sys.prefix, os.getcwd(), home])


def from_validation(exc: ValidationError) -> APIError:
    """A pydantic error on the request body (including malformed JSON) -> 400 naming the first bad field."""
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first['msg']}", code="invalid_json")
    # Union members appear in loc as type names ("list[int]"); keep only field names and indices.
    loc = [str(p) for p in first["loc"] if isinstance(p, int) or "[" not in str(p)]
    param = ".".join(loc) or None
    where = f"'{param}': " if param else ""
    return APIError(400, f"{where}{first['msg']}", param=param, code="invalid_request")


def from_final(exc: FinalError, prompt_param: str = "prompt") -> APIError:
    """One of final.errors' typed errors -> an APIError (4xx for input, 503 when the engine cannot serve)."""
    message = str(exc)
    if isinstance(exc, SequenceError):  # this request's row failed in the engine; the engine serves on
        return APIError(500, message, code="sequence_aborted")
    if isinstance(exc, OverloadedError):
        return APIError(429, message, code="engine_overloaded", type="rate_limit_error",
                        headers={"Retry-After": str(max(1, round(exc.retry_after)))})
    if isinstance(exc, DeadlineError):
        return APIError(504, message, code="deadline_exceeded")
    if isinstance(exc, (EngineError, BackendUnavailableError)):
        return APIError(503, message, code="engine_unavailable")
    if isinstance(exc, UnsupportedError):
        return APIError(400, message, param=_PARAM_NAMES.get(exc.field, exc.field), code="unsupported_parameter")
    if isinstance(exc, ToolsError):
        return APIError(400, message, param=exc.field, code="invalid_tools")
    if isinstance(exc, PromptError):
        return APIError(400, message, param=prompt_param, code="invalid_prompt")
    if isinstance(exc, SamplingError):
        return APIError(400, message, param=_PARAM_NAMES.get(exc.field, exc.field), code="invalid_sampling_parameter")
    if isinstance(exc, CartridgeSourceError):  # refused by this server (403), failed (502) or too slow (504)
        status, code = {"disabled": (403, "cartridge_source_disabled"), "timeout": (504, "cartridge_source_timeout")
                        }.get(exc.reason, (502, "cartridge_source_unreachable"))
        return APIError(status, message, param="cartridges", code=code)
    if isinstance(exc, CartridgeError):  # a <cartridge> block's error names the system message it is in
        param = "messages" if (exc.field or "").startswith("messages") else "cartridges"
        return APIError(400, message, param=param, code="invalid_cartridge")
    if isinstance(exc, ConfigError):
        return APIError(400, message, param=exc.key, code="invalid_config")
    return APIError(400, message, code=type(exc).__name__)
