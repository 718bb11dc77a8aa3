"""rollout.name: tokasaurus — veRL's rollout contract over HTTP to a Tokasaurus server (seed 000), same DataProto.

TokasaurusEngine speaks final's engine dialect (final/rollout/engine_rollout.py) over the Tokasaurus protocol
(final/protocol/): each row is POSTed as token ids to `/custom/cartridge/completions` with
`logprobs_in_fingerprint: true`, as seed 000's TokasaurusHttpServer does, and the answer's `system_fingerprint`
carries the completion ids and the chosen tokens' logprobs. So the batch path, and multi-turn tool calling (the
tools run here, the model there), are the local backend's code. Works against a real Tokasaurus (branch
geoff/cartridges) and against `final serve`.

Config (`rollout.custom`, seed 000):
    tokasaurus_url  "http://localhost:10210"   the server
    cartridges      []                         specs {id, source, force_redownload} sent with every row
    max_retries     5                          retries after the first attempt (connection errors, timeouts, 5xx,
                                               and a busy server's 429 after its Retry-After; never other 4xx),
                                               waiting retry_delay * 2**i between them (plus up to 20% jitter);
                                               then OverloadedError (still 429) or BackendUnavailableError
    base_timeout    120.0                      seconds for attempt 0; attempt i gets base_timeout * 1.5**i
    retry_delay     2.0                        ours (seed 000's implementation hard-codes 2.0)
    weights_dir     null                       ours: update_weights writes the tensors here for the server to
                                               read (a folder both see; the server's `final serve --weights-dir`)
Rows that name cartridges (generate(cartridge=...)) send the configured specs with those ids instead.
"""

from __future__ import annotations

import asyncio
import functools
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from final.engine.messages import Submission
from final.errors import (CartridgeError, ConfigError, EngineError, PromptError, SamplingError,
                          UnsupportedError)
from final.adapters import FolderBase, MergedAdapter, lora_keywords
from final.protocol.bodies import WIRE_CARTRIDGE_KEYS, CartridgeCompletionsRequest
from final.protocol.cartridge_spec import check_cartridge_specs
from final.protocol.fingerprint import read_fingerprint
from final.protocol.http import RequestRejectedError, RetryPolicy, apost_json, async_client
from final.protocol.weights import UPDATE_PATH, rejected, update_body, update_result
from final.rollout.base import BASIC_KEYS, NO_OP, Capabilities, constraint_notes
from final.rollout.engine_rollout import EngineRollout
from final.rollout.thread import LoopThread, gather_or_cancel
from final.weights import check_update, hf_parameter_shapes, save_weights

ENDPOINT = "/custom/cartridge/completions"
NO_GRAMMAR = ("the Tokasaurus protocol (/custom/cartridge/completions) has no constrained decoding: use "
              "rollout.name: local, or final serve's OpenAI routes")
LACKS = ("a Tokasaurus server returns only the generated tokens' own logprobs (packed_chosen_logprobs): no prompt "
         "(echo) logprobs and no top-k alternatives, so scoring needs the local or sglang backend")
# SGLang keys that only shape text output (the server decodes; we read token ids)
_TEXT_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}


@dataclass
class TokasaurusSettings:
    url: str = "http://localhost:10210"
    cartridges: list[dict] = field(default_factory=list)
    max_retries: int = 5
    base_timeout: float = 120.0
    retry_delay: float = 2.0
    weights_dir: str | None = None  # ours: where update_weights writes tensors for the server to read

    @classmethod
    def from_custom(cls, custom: dict, path: str | None = None, where: str = "rollout.custom",
                    also: tuple[str, ...] = ()) -> "TokasaurusSettings":
        """`where`: the block's key path in error messages (final's config and veRL 0.9: rollout.custom; veRL
        0.6.0's trainer config: rollout.engine_kwargs.tokasaurus, final/verl_replica.py); `also`: keys of the block
        that the caller reads itself (the veRL replica's cartridge_replaces_system_turn)."""
        known = {"tokasaurus_url", "cartridges", "max_retries", "base_timeout", "retry_delay", "weights_dir", *also}
        for key in custom:
            if key not in known:
                raise ConfigError(f"unknown key; valid keys: {', '.join(sorted(known))}", key=f"{where}.{key}",
                                  path=path)
        s = cls()
        url = custom.get("tokasaurus_url", s.url)
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"must be an http(s) URL, got {url!r}", key=f"{where}.tokasaurus_url", path=path)
        retries = custom.get("max_retries", s.max_retries)
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigError(f"must be an integer >= 0, got {retries!r}", key=f"{where}.max_retries", path=path)
        numbers = {}
        for key in ("base_timeout", "retry_delay"):
            value = custom.get(key, getattr(s, key))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (key == "base_timeout" and value == 0):
                raise ConfigError(f"must be a finite number {'> 0' if key == 'base_timeout' else '>= 0'}, got "
                                  f"{value!r}", key=f"{where}.{key}", path=path)
            numbers[key] = float(value)
        weights_dir = custom.get("weights_dir")
        if weights_dir is not None and (not isinstance(weights_dir, str) or not weights_dir):
            raise ConfigError(f"must be a folder path, got {weights_dir!r}", key=f"{where}.weights_dir", path=path)
        return cls(url.rstrip("/"), check_specs(custom.get("cartridges") or [], path, f"{where}.cartridges"), retries,
                   **numbers, weights_dir=weights_dir)


def check_specs(specs: Any, path: str | None = None, where: str = "rollout.custom.cartridges") -> list[dict]:
    """Tokasaurus' Cartridge model ({id, source, force_redownload}); sent as written (its default source: wandb)."""
    return check_cartridge_specs(specs, path, where=where, keys=WIRE_CARTRIDGE_KEYS,
                                 fill_defaults=False)


def tokasaurus_body(ids: list[int], params: dict, cartridges: list[dict]) -> dict:
    """SGLang sampling params -> a Tokasaurus CompletionsRequest (final/protocol/bodies.py) for token ids."""
    for key, value in params.items():
        if key not in BASIC_KEYS and key not in _TEXT_ONLY and NO_OP.get(key, object()) != value \
                and not (key == "stop_token_ids" and not value):
            raise SamplingError(f"has no Tokasaurus equivalent (got {value!r})", key)
    if params.get("n", 1) != 1:
        raise SamplingError("must be 1 per row (veRL repeats rows for n > 1)", "n")
    body: dict[str, Any] = {"model": "default", "prompt": list(ids), "max_tokens": params["max_new_tokens"],
                            "temperature": params.get("temperature", 1.0), "top_p": params.get("top_p", 1.0),
                            "n": 1, "logprobs_in_fingerprint": True}
    if params.get("seed") is not None:  # seed 0 is a seed (row 0 of a call seeded 0)
        body["seed"] = params["seed"]
    for key in ("presence_penalty", "frequency_penalty"):
        if params.get(key):  # Tokasaurus refuses non-zero penalties; leave them out unless asked for
            body[key] = params[key]
    stop = params.get("stop")
    if stop:
        body["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if params.get("ignore_eos"):
        body["ignore_eos"] = True
    if cartridges:
        body["cartridges"] = cartridges
    # the server's own request model checks what we send (types, required fields)
    return CartridgeCompletionsRequest.model_validate(body).model_dump(exclude_unset=True)


def sglang_output(data: dict, need_logprobs: bool) -> dict:
    """A Tokasaurus completion (one choice) -> the engine dialect's result dict."""
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
                              "enable_chosen_logprobs=True) and logprobs were asked for")
        logprobs = [math.nan] * len(ids)  # not put in the batch when calculate_log_probs is false
    usage = data.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"output_ids": ids, "meta_info": {
        "id": data.get("id"), "finish_reason": {"type": choice.get("finish_reason")},
        "prompt_tokens": usage.get("prompt_tokens") or 0, "completion_tokens": len(ids), "cached_tokens": cached,
        "output_token_logprobs": [(lp, tok, None) for lp, tok in zip(logprobs, ids)]}}


class TokasaurusEngine:
    """The engine dialect against a Tokasaurus server. Its HTTP client lives on its own event-loop thread, so
    calls from any thread or loop overlap; each row is retried by final.protocol.http's policy."""

    def __init__(self, settings: TokasaurusSettings, max_connections: int, need_logprobs: bool):
        self.settings = settings
        self.need_logprobs = need_logprobs
        self.policy = RetryPolicy(settings.max_retries, settings.retry_delay, 2.0, max_delay=600.0)
        self._loop = LoopThread("final-tokasaurus")
        self._http = self._loop.submit(_client(settings.base_timeout, max(1, max_connections))).result()
        self._closed = False

    async def async_generate(self, input_ids: Any = None, sampling_params: Any = None, return_logprob: Any = False,
                             logprob_start_len: Any = None, cartridges: Any = None, image_data: Any = None,
                             **unsupported: Any) -> dict | list[dict]:
        if unsupported or image_data is not None:
            raise SamplingError(f"not available on the tokasaurus backend: {sorted(unsupported) or ['image_data']}")
        if logprob_start_len is not None and logprob_start_len >= 0:
            raise SamplingError("prompt logprobs are not available from a Tokasaurus server", "logprob_start_len")
        single = bool(input_ids) and isinstance(input_ids[0], int)
        out = await self.submit_generate(input_ids, sampling_params, return_logprob=return_logprob,
                                         cartridges=cartridges).wait()
        return out[0] if single else out

    def submit_generate(self, input_ids: Any, sampling_params: Any = None, *, return_logprob: Any = False,
                        cartridges: Any = None, finish: Callable[[list[dict]], Any] | None = None,
                        on_row: Callable[[int, dict], None] | None = None, logprob_start_len: int | None = None,
                        top_logprobs_num: int | None = None) -> Submission:
        """Build and check every row's body now (typed errors before any request), then send them concurrently."""
        for field, value in (("prompt_logprobs", logprob_start_len), ("top_logprobs", top_logprobs_num)):
            if value is not None and value >= (0 if field == "prompt_logprobs" else 1):
                raise UnsupportedError("tokasaurus", field, LACKS)
        if self._closed:
            raise EngineError("the tokasaurus backend has been shut down")
        rows = [input_ids] if bool(input_ids) and isinstance(input_ids[0], int) else list(input_ids or [])
        if not rows:
            raise PromptError("input_ids must be a non-empty list of token ids or a list of such lists")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(rows)
        if cartridges is None or isinstance(cartridges, str) or all(isinstance(c, str) for c in cartridges):
            carts = [cartridges] * len(rows)  # None: the configured specs; ids: the same for every row
        elif len(cartridges) != len(rows):
            raise CartridgeError(f"has {len(cartridges)} entries for {len(rows)} prompts", field="cartridges")
        else:
            carts = list(cartridges)
        bodies = [tokasaurus_body(ids, p, self._specs(c)) for ids, p, c in zip(rows, params, carts)]
        need = self.need_logprobs or bool(return_logprob)
        future = self._loop.submit(self._all(bodies, need, finish, on_row))
        return Submission(future, future.cancel)

    def cartridge_ids(self) -> list[str]:
        return [c["id"] for c in self.settings.cartridges]

    def flush_cache(self) -> bool:
        """SGLang's dialect: the server owns its caches, so there is nothing to flush from here."""
        return True

    async def update_weights_from_disk(self, path: str, keep_cartridges: bool = False) -> int:
        """POST the server's weight update (final/protocol/weights.py); returns the server's new version."""
        body = update_body(path, keep_cartridges)
        try:
            data = await asyncio.wrap_future(self._loop.submit(
                apost_json(self._http, self.settings.url + UPDATE_PATH, body, self.policy)))
        except RequestRejectedError as exc:
            raise rejected(exc) from None
        return update_result(data)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.submit(self._http.aclose()).result(timeout=30)
        self._loop.close()

    def _specs(self, ids: Any) -> list[dict]:
        """A row's cartridge specs: the configured ones, unless the row names some (by id) or none (())."""
        if ids is None:
            return self.settings.cartridges
        ids = (ids,) if isinstance(ids, str) else tuple(ids)
        by_id = {c["id"]: c for c in self.settings.cartridges}
        missing = sorted(set(ids) - set(by_id))
        if missing:
            raise CartridgeError(f"unknown cartridge id(s) {missing}; the tokasaurus backend sends the specs of "
                                 f"rollout.custom.cartridges: {sorted(by_id)}", field="cartridge")
        return [by_id[c] for c in ids]

    async def _all(self, bodies: list[dict], need_logprobs: bool, finish: Callable | None,
                   on_row: Callable | None) -> Any:
        async def one(i: int, body: dict) -> dict:
            data = await apost_json(self._http, self.settings.url + ENDPOINT, body, self.policy, timeout_growth=1.5)
            out = sglang_output(data, need_logprobs)
            if on_row is not None:
                on_row(i, out)
            return out

        outputs = await gather_or_cancel([one(i, b) for i, b in enumerate(bodies)])
        return finish(outputs) if finish is not None else outputs


async def _client(timeout: float, max_connections: int) -> Any:
    """The client, made on the loop thread that uses it."""
    return async_client(timeout, max_connections)


class TokasaurusRollout(EngineRollout):
    name = "tokasaurus"
    # tools run here against the remote model; no token streams, prompt logprobs or top-k alternatives over this
    # protocol: the server reports only the chosen tokens' logprobs (in system_fingerprint)
    capabilities = Capabilities(cartridges=True, tools=True, call_tools=True, tool_events=True, prompt_logprobs=False,
                                top_logprobs=False, sampling_keys=BASIC_KEYS, weights_by_path=True, notes=(
                                    ("prompt_logprobs", LACKS), ("top_logprobs", LACKS),
                                    *constraint_notes(NO_GRAMMAR),
                                    ("adapter", "Tokasaurus' protocol names no adapter: serve an adapter merged "
                                                "(update_weights with the adapter)")))

    def __init__(self, config: Any, model_config: Any, settings: TokasaurusSettings, device_mesh: Any = None):
        engine = TokasaurusEngine(settings, config.max_num_seqs, bool(config.calculate_log_probs))
        super().__init__(config, model_config, engine, device_mesh)
        self.merged = MergedAdapter(FolderBase(model_config.local_path))  # a trainer's adapter, as merged weights

    @property
    def settings(self) -> TokasaurusSettings:
        return self.engine.settings

    def cartridge_ids(self) -> list[str]:
        return self.engine.cartridge_ids()

    def update_cartridges(self, specs: list[dict]) -> None:
        """Send these specs from now on (seed 000's sync step: save the trained cartridge, then pass its path with
        force_redownload: true so the server reloads it)."""
        self.engine.settings.cartridges = check_specs(specs)

    async def resume(self, tags: list[str]) -> None:
        """The server owns its GPU memory; nothing to bring back."""

    async def release(self) -> None:
        """The server owns its GPU memory; nothing to free here."""

    async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], keep_cartridges: bool = False,
                             **kwargs: Any) -> None:
        """The tensors as one .safetensors file in rollout.custom.weights_dir (a folder this process and the server
        both see: the server's --weights-dir), then the server loads it (POST /update_weights_from_disk, which
        checks the update whole). A real Tokasaurus server has no such route (HTTP 404). LoRA tensors are merged
        here into their modules' bases, read from this process's copy of the model (final/adapters/merge.py)."""
        folder = self.settings.weights_dir
        if folder is None:
            raise UnsupportedError("tokasaurus", "update_weights", "set rollout.custom.weights_dir: a folder this "
                                   "process writes and the server reads (final serve --weights-dir)")
        shapes = functools.partial(hf_parameter_shapes, self.model_config.local_path)  # read for an adapter only
        plan = self.merged.plan(weights, shapes, **lora_keywords(kwargs))
        named = check_update(plan.named, None)  # names and shapes are the server's to check
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix="final-update-", suffix=".safetensors") as file:
            save_weights(named, file.name)
            await self.update_weights_from_disk(file.name, keep_cartridges)
        plan.commit()

    async def update_weights_from_disk(self, path: str, keep_cartridges: bool = False) -> None:
        """The server loads an HF folder or .safetensors file it can read (under its --weights-dir); its
        cartridges are kept (stale) only with keep_cartridges."""
        await self.engine.update_weights_from_disk(path, keep_cartridges)


def build(engine_config: Any, rollout_config: Any, model_config: Any) -> TokasaurusRollout:
    settings = TokasaurusSettings.from_custom(engine_config.custom or {}, engine_config.source)
    return TokasaurusRollout(rollout_config, model_config, settings)
