"""InferenceEngine: prompts in, completions out, through veRL's rollout contract (seed 003's API).

    engine = InferenceEngine("config.yaml")
    out = engine.generate("What is the capital of France?", temperature=0)
    print(out.completions[0])

normalize -> tokenize into a DataProto -> rollout.generate_sequences (on the rollout thread) -> decode.
"""

from __future__ import annotations

import atexit
import contextlib
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from final.config import EngineConfig, load_config
from final.errors import CartridgeError, ConfigError, EngineError, PromptError, SamplingError
from final.models import cache_dir, model_eos_token_ids, resolve_model_path
from final.prompts import build_dataproto, decode_outputs, normalize_prompts, tokenize
from final.rollout import build_rollout
from final.rollout.multi_turn import TRACE_KEY
from final.rollout.thread import RolloutThread
from final.tools.outputs import conversation_rows

SAMPLING_KEYS = {"temperature", "top_p", "top_k", "min_p", "max_tokens", "max_new_tokens", "n", "do_sample", "seed",
                 "stop", "stop_token_ids", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_new_tokens"}
PROGRESS_MIN_ROWS = 32


@dataclass
class GenerationOutput:
    """Rows are prompt-major: with n samples per prompt, rows i*n .. i*n+n-1 belong to prompt i."""

    completions: list[str]
    token_ids: list[list[int]]
    metadata: list[dict] = field(default_factory=list)
    n: int = 1

    def grouped(self) -> list[list[str]]:
        """Completions as one list of n samples per prompt."""
        return [self.completions[i:i + self.n] for i in range(0, len(self.completions), self.n)]


class InferenceEngine:
    def __init__(self, config: str | Path | dict = "config.yaml", **overrides: Any):
        self.config: EngineConfig = load_config(config, overrides)
        self.backend = self.config.backend
        if self.backend == "sglang":  # missing CUDA/sglang is reported before any model download
            from final.rollout.sglang import preflight

            preflight(self.config)
        self.model_dir = resolve_model_path(self.config.model_path)
        self.max_model_len = self.config.check_against_model(self.model_dir)
        self._thread = RolloutThread()
        self._closed = False
        try:
            self.rollout_config = self.config.rollout_config()
            self.model_config = self.config.model_config(self.model_dir)
            self.rollout = self._thread.run(build_rollout, self.config, self.rollout_config, self.model_config)
        except BaseException:
            self._thread.close()
            raise
        self.tokenizer = getattr(self.model_config.tokenizer, "tokenizer", self.model_config.tokenizer)
        self.pad_token_id = self.rollout.pad_token_id
        eos = set(model_eos_token_ids(self.model_dir))
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self.cartridges = self._cartridge_service()
        _live.add(self)

    # ---- public API ----------------------------------------------------------------------------------
    @property
    def engine(self):
        """The embedded engine when the backend is local (else None)."""
        return getattr(self.rollout, "engine", None)

    def generate(self, prompts: Any, *, cartridge: Any = None, tools_kwargs: Any = None, raw: bool = False,
                 progress: bool | None = None, **sampling: Any) -> GenerationOutput:
        """Generate for a str, list[str], a message list, a list of message lists, or token ids.

        Sampling keys (seed 003 plus ours): temperature, top_p, top_k, min_p, max_tokens, n, do_sample, seed, stop,
        stop_token_ids, ignore_eos, logprobs, presence/frequency/repetition_penalty, min_new_tokens.
        """
        job = self._prepare(prompts, cartridge, tools_kwargs, raw, progress, sampling)
        return self._finish(job, self._thread.run(self._run, job))

    async def agenerate(self, prompts: Any, *, cartridge: Any = None, tools_kwargs: Any = None, raw: bool = False,
                        progress: bool | None = None, **sampling: Any) -> GenerationOutput:
        """Awaitable generate(); safe inside a running event loop (a Jupyter cell, a server)."""
        job = self._prepare(prompts, cartridge, tools_kwargs, raw, progress, sampling)
        return self._finish(job, await self._thread.arun(self._run, job))

    def check(self, prompts: Any, *, cartridge: Any = None, tools_kwargs: Any = None, raw: bool = False,
              progress: bool | None = None, **sampling: Any) -> int:
        """Validate a generate() call without running it: raises the typed error generate() would raise for
        these arguments, else returns the number of rows it would produce (final.distributed checks a whole
        call once, so errors name global prompt indices before any row is shared out)."""
        return self._prepare(prompts, cartridge, tools_kwargs, raw, progress, sampling)["rows"]

    def load_cartridge(self, id: str | None = None, source: str = "local", path: str | None = None,  # noqa: A002
                       force_redownload: bool = False, pin: bool = False) -> str:
        """Load a cartridge (file checked against its manifest and the model) and return its id."""
        return self._require_cartridges().load(id=id, source=source, path=path,
                                               force_redownload=force_redownload, pin=pin)

    def unload_cartridge(self, cartridge_id: str) -> bool:
        """Forget a cartridge; requests already running with it finish normally."""
        return self._require_cartridges().unload(cartridge_id)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        try:
            closer = getattr(self.rollout, "shutdown", None)
            if closer is not None:
                self._thread.run(closer)
        finally:
            self._thread.close()

    def __enter__(self) -> "InferenceEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- internals -----------------------------------------------------------------------------------
    def _prepare(self, prompts, cartridge, tools_kwargs, raw, progress, sampling) -> dict:
        if self._closed:
            raise EngineError("this InferenceEngine has been shut down")
        kwargs, meta, n, stop_ids = self._sampling_kwargs(sampling)
        logprobs = meta.pop("_logprobs")
        items = normalize_prompts(prompts, raw=raw)
        carts = self._cartridges_per_prompt(cartridge, len(items))
        ids = tokenize(items, self.tokenizer, self.rollout_config.prompt_length,
                       after_cartridge=[bool(c) for c in carts] if carts else None)
        non_tensor: dict[str, list] = {}
        if carts is not None:
            non_tensor["cartridges"] = carts
        if self.rollout_config.multi_turn.enable:
            if any(p.messages is None for p in items):
                raise PromptError("multi-turn tool calling needs chat prompts (strings or message lists), "
                                  "not raw text or token ids")
            # each row offers the tools named in its tools_kwargs (veRL); default: every tool, no kwargs
            default = {name: {} for name in self._tool_names()}
            non_tensor["tools_kwargs"] = _per_prompt(default if tools_kwargs is None else tools_kwargs,
                                                     len(items), "tools_kwargs")
            meta[TRACE_KEY] = True
        elif tools_kwargs is not None:
            raise ConfigError("tools_kwargs needs tool calling: set rollout.multi_turn.enable: true and "
                              "tool_config_path", key="rollout.multi_turn.enable", path=self.config.source)
        if n > 1:  # veRL's ray_trainer repeats prompts (interleaved) rather than asking the engine for n
            ids = [x for x in ids for _ in range(n)]
            items = [x for x in items for _ in range(n)]
            non_tensor = {k: [x for x in v for _ in range(n)] for k, v in non_tensor.items()}
        data = build_dataproto(ids, items, self.pad_token_id, sorted(set(self.eos_token_ids) | set(stop_ids)),
                               meta_info=meta, non_tensor=non_tensor)
        show = self.config.progress if progress is None else progress
        return {"data": data, "kwargs": kwargs, "n": n, "stop_ids": stop_ids, "rows": len(ids),
                "progress": bool(show) and len(ids) >= PROGRESS_MIN_ROWS, "logprobs": logprobs,
                "cartridge_ids": sorted({c for row in carts or [] for c in row})}

    def _run(self, job: dict):
        bar = None
        if job["progress"] and hasattr(self.rollout, "on_request_done"):
            from tqdm.auto import tqdm

            bar = tqdm(total=job["rows"], desc="generate", unit="seq")
            self.rollout.on_request_done = bar.update
        # Backends without a local cartridge store (tokasaurus) resolve cartridge ids themselves.
        held = self.cartridges.using(job["cartridge_ids"]) if job["cartridge_ids"] and self.cartridges is not None \
            else contextlib.nullcontext()
        try:
            with held:  # the store cannot evict a cartridge while this call uses it
                return self.rollout.generate_sequences(job["data"], **job["kwargs"])
        finally:
            if bar is not None:
                self.rollout.on_request_done = None
                bar.close()

    def _finish(self, job: dict, output) -> GenerationOutput:
        if "messages" in output.non_tensor_batch:  # multi-turn: whole conversations, tool turns included
            conv = conversation_rows(output, self.tokenizer)
            meta = [{**r.to_metadata(), "prompt_index": i // job["n"], "sample_index": i % job["n"]}
                    for i, r in enumerate(conv)]
            return GenerationOutput([r.final_text for r in conv], [r.response_ids for r in conv], meta, job["n"])
        rows = decode_outputs(output, self.tokenizer, set(self.eos_token_ids) | set(job["stop_ids"]),
                              job["kwargs"]["max_new_tokens"])
        meta = []
        for i, r in enumerate(rows):
            m = {"response_ids": r.response_ids, "response_mask": r.response_mask, "finish_reason": r.finish_reason,
                 "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                 "prompt_index": i // job["n"], "sample_index": i % job["n"]}
            if job["logprobs"]:
                m["logprobs"] = r.logprobs
            meta.append(m)
        return GenerationOutput([r.text for r in rows], [r.response_ids for r in rows], meta, job["n"])

    def _sampling_kwargs(self, sampling: dict) -> tuple[dict, dict, int, list[int]]:
        """Seed 003's sampling kwargs -> (generate_sequences kwargs, meta_info, n, extra stop ids)."""
        from final.engine.sampling_params import SamplingParams

        unknown = set(sampling) - SAMPLING_KEYS
        if unknown:
            raise SamplingError(f"unknown sampling argument; valid: {', '.join(sorted(SAMPLING_KEYS))}",
                                sorted(unknown)[0])
        s = dict(sampling)
        if "max_tokens" in s and "max_new_tokens" in s:
            raise SamplingError("give max_tokens or max_new_tokens, not both", "max_tokens")
        max_tokens = s.pop("max_tokens", s.pop("max_new_tokens", self.rollout_config.response_length))
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
            raise SamplingError(f"must be a positive integer, got {max_tokens!r}", "max_tokens")
        if max_tokens > self.rollout_config.response_length:
            raise SamplingError(f"{max_tokens} exceeds rollout.response_length={self.rollout_config.response_length}",
                                "max_tokens")
        n = s.pop("n", 1)
        logprobs = s.pop("logprobs", False)
        if logprobs and not self.rollout_config.calculate_log_probs:
            raise SamplingError("needs rollout.calculate_log_probs: true in the config", "logprobs")
        do_sample = s.pop("do_sample", True)
        if not isinstance(do_sample, bool):
            raise SamplingError(f"must be true or false, got {do_sample!r}", "do_sample")
        SamplingParams.from_dict({**s, "n": n, "max_new_tokens": max_tokens})  # range checks, typed errors
        if s.get("temperature", 1.0) == 0:
            do_sample = False
        if not do_sample:  # veRL's greedy settings apply; don't let sampling knobs undo them
            for key in ("temperature", "top_p", "top_k", "min_p"):
                s.pop(key, None)
        kwargs = {**s, "max_new_tokens": max_tokens}
        meta = {"do_sample": do_sample, "_logprobs": bool(logprobs)}
        return kwargs, meta, n, list(s.get("stop_token_ids") or [])

    def _cartridges_per_prompt(self, cartridge: Any, n_prompts: int) -> list[tuple[str, ...]] | None:
        """"id" | ["a", "b"] (composed, for every prompt) | one entry per prompt (str, list or None)."""
        if cartridge is None:
            return None
        if isinstance(cartridge, str):
            rows = [(cartridge,)] * n_prompts
        elif isinstance(cartridge, (list, tuple)) and all(isinstance(c, str) for c in cartridge):
            rows = [tuple(cartridge)] * n_prompts
        elif isinstance(cartridge, (list, tuple)):
            if len(cartridge) != n_prompts:
                raise CartridgeError(f"has {len(cartridge)} entries for {n_prompts} prompts", field="cartridge")
            rows = [() if c is None else (c,) if isinstance(c, str) else tuple(c) for c in cartridge]
        else:
            raise CartridgeError(f"must be an id, a list of ids or one entry per prompt, got {cartridge!r}",
                                 field="cartridge")
        known = self._known_cartridges()
        if known is not None:
            missing = sorted({c for row in rows for c in row} - set(known))
            if missing:
                raise CartridgeError(f"unknown cartridge id(s) {missing}; loaded: {sorted(known)}", field="cartridge")
        return rows

    def _tool_names(self) -> list[str]:
        multi_turn = getattr(self.rollout, "multi_turn", None)
        if multi_turn is not None:
            return multi_turn.tools.names()
        return sorted(getattr(self.rollout, "_tool_map", {}))  # veRL's SGLangRollout

    def _known_cartridges(self) -> list[str] | None:
        return self.cartridges.ids() if self.cartridges is not None else None

    def _cartridge_service(self):
        """Cartridges need a backend that can hold KV: the embedded engine or the SGLang injector."""
        target = getattr(self.rollout, "cartridge_backend", None) or self.engine
        if target is None:
            return None
        from final.cartridges.service import CartridgeService

        service = CartridgeService(target, model=self.model_dir, cache_dir=cache_dir() / "cartridges")
        for spec in self.config.cartridges:
            service.load(**spec)
        return service

    def _require_cartridges(self):
        if self.cartridges is None:
            raise CartridgeError(f"the {self.backend} backend serves no cartridges from this process "
                                 "(use the local or sglang backend)", field="backend")
        return self.cartridges


def _per_prompt(value: Any, n: int, name: str) -> list:
    if isinstance(value, dict):
        return [value] * n
    if isinstance(value, list) and len(value) == n:
        return value
    raise SamplingError(f"must be a dict (same for every prompt) or a list with one dict per prompt ({n})", name)


_live: "weakref.WeakSet[InferenceEngine]" = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    # Engines left open at interpreter exit would otherwise hold threads and (on GPU) device memory.
    for engine in list(_live):
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
