"""Seed 001's agent LM client for Tokasaurus-protocol servers (retries: final.protocol.http).

    from final.client import get_lm_client
    lm = get_lm_client({"model": "toka:meta-llama/Llama-3.2-3B-Instruct", "base_url": "http://127.0.0.1:10210",
                        "temperature": 0.0, "max_output_tokens": 512, "protocol": "openai"})
    text = lm.call("You are terse.", "Name a prime.")

Model strings with the `toka:` prefix route to a Tokasaurus-protocol server (a real Tokasaurus or `final serve`).
protocol "openai": POST /v1/chat/completions (with cartridges: /custom/cartridge/chat/completions, same body plus
`cartridges`). protocol "toka": seed 001's native POST /generate {model, system, prompt, temperature, max_tokens,
stop} -> {text, finish_reason, usage}; `final serve` answers it, real Tokasaurus has no /generate.
Connection errors, timeouts and 5xx are retried with exponential backoff, and a busy server's 429/503 after its
Retry-After, each wait stretched by up to `jitter` (a fraction, random); other 4xx are not retried
(RequestRejectedError). After `max_retries` retries a 429 is OverloadedError, anything else BackendUnavailableError
saying what failed. A request that meets a keep-alive connection the server closed while idle is sent again at once
(final.protocol.http). Each call logs its latency and token counts on
the `final.client` logger (and the prompt and reply with log_calls).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import httpx

from final.errors import BackendUnavailableError, ConfigError, PromptError
from final.protocol.fingerprint import read_fingerprint
from final.protocol.http import RequestRejectedError, RetryPolicy, client, post_json, request_json
from final.protocol.weights import UPDATE_PATH, VERSION_PATH, rejected, update_body, update_result

__all__ = ["LMConfig", "LMResponse", "RequestRejectedError", "TokasaurusClient", "get_lm_client"]

logger = logging.getLogger("final.client")

PREFIX = "toka:"
PROTOCOLS = ("openai", "toka")


# ---- seed 001's LM client -------------------------------------------------------------------------------
@dataclass
class LMConfig:
    """Seed 001's lm_config (LMConfig + TokasaurusConfig fields), validated."""

    model: str
    temperature: float = 0.0
    max_output_tokens: int = 1024
    log_calls: bool = False
    base_url: str = "http://127.0.0.1:10210"
    protocol: str = "openai"
    stop_sequences: list[str] = field(default_factory=list)
    api_key: str | None = None
    timeout_s: float = 900.0
    max_retries: int = 3
    starting_delay: float = 1.0
    backoff_factor: float = 2.0
    max_delay: float = 60.0
    jitter: float = 0.2  # ours: each wait between retries is stretched by a random fraction in [0, jitter)
    enable_health_check: bool = False
    cartridges: list[dict] = field(default_factory=list)  # ours: Tokasaurus specs sent with every call

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "LMConfig":
        """A config from seed 001's dict; an unknown key is a ConfigError naming it."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        for key in values:
            if key not in names:
                raise ConfigError(f"unknown key; valid keys: {', '.join(sorted(names))}", key=f"lm_config.{key}")
        if not isinstance(values.get("model"), str) or not values["model"]:
            raise ConfigError("is required (e.g. 'toka:meta-llama/Llama-3.2-3B-Instruct')", key="lm_config.model")
        cfg = cls(**{k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in values.items()})
        cfg._check()
        return cfg

    def _check(self) -> None:
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"{why}, got {getattr(self, key)!r}", key=f"lm_config.{key}")

        if self.protocol not in PROTOCOLS:
            raise bad("protocol", f"must be one of {', '.join(PROTOCOLS)}")
        if not self.base_url.startswith(("http://", "https://")):
            raise bad("base_url", "must be an http(s) URL")
        for key in ("temperature", "timeout_s", "starting_delay", "backoff_factor", "max_delay", "jitter"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise bad(key, "must be a number >= 0")
        for key, least in (("max_output_tokens", 1), ("max_retries", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise bad(key, f"must be an integer >= {least}")
        if not isinstance(self.stop_sequences, list) or not all(isinstance(s, str) and s for s in self.stop_sequences):
            raise bad("stop_sequences", "must be a list of non-empty strings")
        carts = self.cartridges
        if not isinstance(carts, list) or not all(isinstance(c, dict) and c.get("id") for c in carts):
            raise bad("cartridges", "must be a list of {id, source, force_redownload}")


@dataclass
class LMResponse:
    """One answer: its text, finish reason, token usage, the seconds it took and the generated token ids."""

    text: str
    finish_reason: str | None
    usage: dict[str, Any]
    latency_s: float
    token_ids: list[int] | None = None  # from Tokasaurus' system_fingerprint, when the server sends it


class TokasaurusClient:
    """Blocking client for a Tokasaurus-protocol server (seed 001's LanguageModel interface: call())."""

    def __init__(self, config: LMConfig | Mapping[str, Any]):
        self.config = config if isinstance(config, LMConfig) else LMConfig.from_dict(config)
        if not self.config.model.startswith(PREFIX):
            raise ConfigError(f"must start with '{PREFIX}' to use TokasaurusClient", key="lm_config.model")
        self.model = self.config.model[len(PREFIX):] or "default"
        self.base_url = self.config.base_url.rstrip("/")
        self.policy = RetryPolicy(self.config.max_retries, self.config.starting_delay, self.config.backoff_factor,
                                  self.config.max_delay, self.config.jitter)
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        self._http = client(self.config.timeout_s, headers)

    def ping(self) -> bool:
        """Whether the server answers GET /ping with pong (within 5 s)."""
        try:
            r = self._http.get(f"{self.base_url}/ping", timeout=5)
            return r.status_code == 200 and r.json().get("message") == "pong"
        except (httpx.HTTPError, ValueError):
            return False

    def call(self, system_prompt: str | None, user_prompt: str) -> str:
        """Seed 001's call: one system and one user message -> the reply's text."""
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
            [{"role": "user", "content": user_prompt}]
        return self.chat(messages).text

    def chat(self, messages: list[dict], cartridges: list[dict] | None = None) -> LMResponse:
        """One chat completion (with cartridges: the cartridge chat route), retried as the config says."""
        carts = list(self.config.cartridges) + list(cartridges or [])
        if self.config.enable_health_check and not self.ping():
            logger.debug("health check of %s failed; sending anyway (cold start)", self.base_url)
        url, payload = self._request(messages, carts)
        start = time.perf_counter()
        data = post_json(self._http, url, payload, self.policy)
        result = self._parse(data, time.perf_counter() - start)
        self._log(messages, result)
        return result

    def update_weights_from_disk(self, model_path: str, keep_cartridges: bool = False) -> int:
        """Have the server load new weights from an HF folder or .safetensors file under its --weights-dir
        (SGLang's POST /update_weights_from_disk); returns the server's new weights version. Requests in flight
        there finish on the old weights first. WeightsError when the server refuses the update, naming the
        parameter; RequestRejectedError 403 when the server takes no updates."""
        try:
            data = post_json(self._http, f"{self.base_url}{UPDATE_PATH}", update_body(model_path, keep_cartridges),
                             self.policy)
        except RequestRejectedError as exc:
            raise rejected(exc) from None
        return update_result(data)

    def weights_version(self) -> int:
        """The server's weights version (GET /get_weight_version), retried as the config says."""
        return int(request_json(self._http, "GET", f"{self.base_url}{VERSION_PATH}", None, self.policy)
                   ["weight_version"])

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._http.close()

    def __enter__(self) -> "TokasaurusClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------------------------
    def _request(self, messages: list[dict], carts: list[dict]) -> tuple[str, dict]:
        cfg = self.config
        stop = {"stop": cfg.stop_sequences} if cfg.stop_sequences else {}
        extra = {"cartridges": carts} if carts else {}
        if cfg.protocol == "toka":
            roles = [m.get("role") for m in messages]
            if roles not in (["user"], ["system", "user"]):
                raise PromptError(f"protocol 'toka' (/generate) takes [system,] user messages, got roles {roles}")
            body = {"model": self.model, "prompt": messages[-1]["content"], "temperature": cfg.temperature,
                    "max_tokens": cfg.max_output_tokens, **stop, **extra}
            if len(messages) == 2:
                body["system"] = messages[0]["content"]
            return f"{self.base_url}/generate", body
        path = "/custom/cartridge/chat/completions" if carts else "/v1/chat/completions"
        return f"{self.base_url}{path}", {"model": self.model, "messages": messages, "temperature": cfg.temperature,
                                          "max_tokens": cfg.max_output_tokens, **stop, **extra}

    def _parse(self, data: dict, latency: float) -> LMResponse:
        usage = data.get("usage") or {}
        if self.config.protocol == "toka":
            text = data.get("text", data.get("output"))
            if not isinstance(text, str):
                raise BackendUnavailableError(f"the /generate answer has no text: {str(data)[:200]}")
            return LMResponse(text, data.get("finish_reason"), usage, latency)
        choice = (data.get("choices") or [None])[0]
        if not isinstance(choice, dict):
            raise BackendUnavailableError(f"the server's answer has no choices: {str(data)[:200]}")
        text = (choice.get("message") or {}).get("content") or ""
        try:
            token_ids = read_fingerprint(data.get("system_fingerprint"))[0][0]
        except (ValueError, IndexError):
            token_ids = None  # a plain OpenAI server
        return LMResponse(text, choice.get("finish_reason"), usage, latency, token_ids)

    def _log(self, messages: list[dict], r: LMResponse) -> None:
        metrics = {"model": self.config.model, "protocol": self.config.protocol, "latency_s": round(r.latency_s, 4),
                   "input_tokens": r.usage.get("prompt_tokens"), "output_tokens": r.usage.get("completion_tokens"),
                   "total_tokens": r.usage.get("total_tokens"), "finish_reason": r.finish_reason}
        logger.info("lm call %s", metrics, extra={"metrics": metrics})
        if r.finish_reason == "length":
            logger.warning("reply truncated at max_output_tokens=%d", self.config.max_output_tokens)
        if self.config.log_calls:
            logger.info("lm call messages=%s reply=%r", messages, r.text)


def get_lm_client(config: LMConfig | Mapping[str, Any]) -> TokasaurusClient:
    """Seed 001's lm_factory.get_lm_client: route by the model string's prefix (only `toka:` here)."""
    cfg = config if isinstance(config, LMConfig) else LMConfig.from_dict(config)
    if not cfg.model.startswith(PREFIX):
        raise ConfigError(f"has no supported prefix; final.client serves '{PREFIX}<model>' models, got {cfg.model!r}",
                          key="lm_config.model")
    return TokasaurusClient(cfg)
