"""TokasaurusRollout: veRL's BaseRollout over HTTP to a Tokasaurus server (seed 000), same DataProto as the others.

Each row is POSTed as token ids to `/custom/cartridge/completions` with `logprobs_in_fingerprint: true`, the way
seed 000's TokasaurusHttpServer does; the answer's `system_fingerprint` carries the completion ids and the chosen
tokens' logprobs (final/server/fingerprint.py). Rows run concurrently; the DataProto is assembled by
final/rollout/batch.py exactly as for the local backend. Works against a real Tokasaurus (branch
geoff/cartridges) and against `final serve`.

Config (`rollout.custom`, seed 000):
    tokasaurus_url  "http://localhost:10210"   the server
    cartridges      []                         specs {id, source, force_redownload} sent with every row
    max_retries     5                          retries after the first attempt (connection errors, timeouts, 5xx;
                                               never 4xx), waiting retry_delay * 2**i between them
    base_timeout    120.0                      seconds for attempt 0; attempt i gets base_timeout * 1.5**i
    retry_delay     2.0                        ours (seed 000's implementation hard-codes 2.0)
Rows that name cartridges (non_tensor_batch["cartridges"], from generate(cartridge=...)) send the configured
specs with those ids instead.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

import torch
from verl.workers.rollout.base import BaseRollout

from final.client import RetryPolicy, apost_json
from final.config import check_cartridge_specs
from final.errors import BackendUnavailableError, CartridgeError, ConfigError, EngineError, SamplingError
from final.rollout.batch import (assemble_batch, base_sampling_params, prompt_token_lists, request_sampling_params,
                                 row_cartridges)
from final.rollout.thread import run_until_complete
from final.server.fingerprint import read_fingerprint

ENDPOINT = "/custom/cartridge/completions"
SPEC_KEYS = ("id", "source", "force_redownload")
# SGLang sampling keys with no Tokasaurus field: refused unless left at their no-op value.
_NO_FIELD = {"top_k": (-1, None), "min_p": (0, 0.0, None), "repetition_penalty": (1, 1.0, None),
             "min_new_tokens": (0, None), "stop_token_ids": (None, (), []), "regex": (None,), "json_schema": (None,),
             "ebnf": (None,), "structural_tag": (None,), "custom_params": (None,), "logit_bias": (None,)}
_TEXT_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}


@dataclass
class TokasaurusSettings:
    url: str = "http://localhost:10210"
    cartridges: list[dict] = field(default_factory=list)
    max_retries: int = 5
    base_timeout: float = 120.0
    retry_delay: float = 2.0

    @classmethod
    def from_custom(cls, custom: dict, path: str | None = None) -> "TokasaurusSettings":
        known = {"tokasaurus_url", "cartridges", "max_retries", "base_timeout", "retry_delay"}
        for key in custom:
            if key not in known:
                raise ConfigError(f"unknown key; valid keys: {', '.join(sorted(known))}", key=f"rollout.custom.{key}",
                                  path=path)
        s = cls()
        url = custom.get("tokasaurus_url", s.url)
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"must be an http(s) URL, got {url!r}", key="rollout.custom.tokasaurus_url", path=path)
        retries = custom.get("max_retries", s.max_retries)
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigError(f"must be an integer >= 0, got {retries!r}", key="rollout.custom.max_retries", path=path)
        numbers = {}
        for key in ("base_timeout", "retry_delay"):
            value = custom.get(key, getattr(s, key))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
                    or (key == "base_timeout" and value == 0):
                raise ConfigError(f"must be a number {'> 0' if key == 'base_timeout' else '>= 0'}, got {value!r}",
                                  key=f"rollout.custom.{key}", path=path)
            numbers[key] = float(value)
        return cls(url.rstrip("/"), check_specs(custom.get("cartridges") or [], path), retries, **numbers)


def check_specs(specs: Any, path: str | None = None) -> list[dict]:
    """Tokasaurus' Cartridge model ({id, source, force_redownload}); sent as written (its default source: wandb)."""
    return check_cartridge_specs(specs, path, where="rollout.custom.cartridges", keys=SPEC_KEYS, fill_defaults=False)


def tokasaurus_body(ids: list[int], params: dict, cartridges: list[dict]) -> dict:
    """SGLang sampling params -> a Tokasaurus CompletionsRequest (tokasaurus/server/types.py) for token ids."""
    for key, value in params.items():
        if key in _NO_FIELD and value not in _NO_FIELD[key]:
            raise SamplingError(f"has no Tokasaurus equivalent (got {value!r})", key)
        if key not in _NO_FIELD and key not in _TEXT_ONLY and key not in {
                "max_new_tokens", "temperature", "top_p", "n", "seed", "stop", "ignore_eos", "presence_penalty",
                "frequency_penalty"}:
            raise SamplingError("is not a sampling parameter the tokasaurus backend knows", key)
    if params.get("n", 1) != 1:
        raise SamplingError("must be 1 per row (veRL repeats rows for n > 1)", "n")
    body: dict[str, Any] = {"model": "default", "prompt": list(ids), "max_tokens": params["max_new_tokens"],
                            "temperature": params.get("temperature", 1.0), "top_p": params.get("top_p", 1.0),
                            "n": 1, "logprobs_in_fingerprint": True}
    for key in ("seed", "presence_penalty", "frequency_penalty"):
        if params.get(key):  # Tokasaurus refuses non-zero penalties; leave them out unless asked for
            body[key] = params[key]
    stop = params.get("stop")
    if stop:
        body["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if params.get("ignore_eos"):
        body["ignore_eos"] = True
    if cartridges:
        body["cartridges"] = cartridges
    return body


def sglang_output(data: dict, need_logprobs: bool) -> dict:
    """A Tokasaurus completion (one choice) -> the SGLang dict assemble_batch reads."""
    try:
        ids_per_choice, logprobs_per_choice = read_fingerprint(data.get("system_fingerprint"))
        ids = ids_per_choice[0]
        choice = data["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise EngineError(f"unexpected answer from the Tokasaurus server: {exc}") from exc
    logprobs = logprobs_per_choice[0] if logprobs_per_choice else None
    if logprobs is None or len(logprobs) != len(ids):
        if need_logprobs:
            raise EngineError("the server sent no logprobs for the completion tokens (Tokasaurus: start it with "
                              "enable_chosen_logprobs=True) and rollout.calculate_log_probs is true")
        logprobs = [math.nan] * len(ids)  # not put in the batch when calculate_log_probs is false
    usage = data.get("usage") or {}
    return {"output_ids": ids, "meta_info": {
        "id": data.get("id"), "finish_reason": {"type": choice.get("finish_reason")},
        "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": len(ids),
        "output_token_logprobs": [(lp, tok, None) for lp, tok in zip(logprobs, ids)]}}


class TokasaurusRollout(BaseRollout):
    def __init__(self, config, model_config, settings: TokasaurusSettings, device_mesh=None):
        super().__init__(config, model_config, device_mesh)
        if config.multi_turn.enable:
            raise ConfigError("multi-turn tool calling is not available on the tokasaurus backend",
                              key="rollout.multi_turn.enable")
        self.processing_class = model_config.get_processor()
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.settings = settings
        self.policy = RetryPolicy(settings.max_retries, settings.retry_delay, 2.0, max_delay=600.0)
        self.sampling_params = base_sampling_params(config)
        self.on_request_done: Callable[[], None] | None = None  # progress hook, as LocalRollout

    @property
    def cartridges(self) -> list[dict]:
        return self.settings.cartridges

    def update_cartridges(self, specs: list[dict]) -> None:
        """Send these specs from now on (seed 000's sync step: save the trained cartridge, then pass its path with
        force_redownload: true so the server reloads it)."""
        self.settings.cartridges = check_specs(specs)

    # ---- BaseRollout ---------------------------------------------------------------------------------
    @torch.no_grad()
    def generate_sequences(self, prompts, **kwargs):
        idx_list = prompt_token_lists(prompts, self.pad_token_id)
        params = request_sampling_params(self.sampling_params, self.config, prompts.meta_info, kwargs)
        seed = params.pop("seed", None)
        specs = self._row_specs(prompts, len(idx_list))
        bodies = [tokasaurus_body(ids, dict(params, seed=seed + i) if seed is not None else params, specs[i])
                  for i, ids in enumerate(idx_list)]
        outputs = run_until_complete(self._all(bodies))
        return assemble_batch(prompts, outputs, self.config, self.pad_token_id)

    async def resume(self, tags: list[str]) -> None:
        """The server owns its GPU memory; nothing to bring back."""

    async def release(self) -> None:
        """The server owns its GPU memory; nothing to free here."""

    async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None], **kwargs) -> None:
        raise BackendUnavailableError("a Tokasaurus server's base model is fixed: train a cartridge instead and "
                                      "send it with update_cartridges([{id, source, force_redownload: true}])")

    # ---- internals -----------------------------------------------------------------------------------
    def _row_specs(self, prompts, rows: int) -> list[list[dict]]:
        named = row_cartridges(prompts)
        if named is None:
            return [self.cartridges] * rows
        by_id = {c["id"]: c for c in self.cartridges}
        missing = sorted({c for row in named for c in row} - set(by_id))
        if missing:
            raise CartridgeError(f"unknown cartridge id(s) {missing}; the tokasaurus backend sends the specs of "
                                 f"rollout.custom.cartridges: {sorted(by_id)}", field="cartridge")
        return [[by_id[c] for c in row] for row in named]

    async def _all(self, bodies: list[dict]) -> list[dict]:
        import httpx

        limits = httpx.Limits(max_connections=max(1, self.config.max_num_seqs))
        need = bool(self.config.calculate_log_probs)
        async with httpx.AsyncClient(timeout=self.settings.base_timeout, limits=limits) as http:
            async def one(body: dict) -> dict:
                data = await apost_json(http, self.settings.url + ENDPOINT, body, self.policy, timeout_growth=1.5)
                if self.on_request_done is not None:
                    self.on_request_done()
                return sglang_output(data, need)

            tasks = [asyncio.ensure_future(one(b)) for b in bodies]
            try:
                return await asyncio.gather(*tasks)
            except BaseException:  # one failed row fails the call; don't leave the others running
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise


def build(engine_config, rollout_config, model_config) -> TokasaurusRollout:
    settings = TokasaurusSettings.from_custom(engine_config.custom or {}, engine_config.source)
    return TokasaurusRollout(rollout_config, model_config, settings)
