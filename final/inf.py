"""InferenceEngine: prompts in, completions out, through veRL's rollout contract (seed 003's API).

    engine = InferenceEngine("config.yaml")
    out = engine.generate("What is the capital of France?", temperature=0)
    print(out.completions[0])

The only composition root: the CLI, chat, the server, evals and bench all build on it. A call is
prepare (final/request.py: validate, tokenize, refuse what the backend cannot serve) -> the veRL DataProto ->
backend.generate_sequences (final/rollout/base.py's interface) -> one record per row (final/outputs.py).
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import weakref
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from final.adapters import adapter_name
from final.admission import Admission
from final.calls import CallObserver, aholding, holding, loop_running, off_loop, until_deadline, within_deadline
from final.cartridges.service import CartridgeService
from final.config import EngineConfig, load_config
from final.engine import EmbeddedEngine
from final.errors import CartridgeError, EngineError
from final.models import cache_dir, eos_token_ids, model_positions, resolve_model_path
from final.outputs import (ROW_INFO, Completion, GenerationOutput, Score, completion_text, completions_of,
                            raise_if_aborted)
from final.request import CallRules, Request, prepare_score
from final.rollout import Backend, backend_class, build_backend
from final.rollout.thread import RolloutThread
from final.tools.call import Reading, prepare_call, template_call
from final.tools.outputs import conversation_rows
from final.tools.reply import read_output
from final.weight_sync import WeightSync

__all__ = ["GenerationOutput", "InferenceEngine", "Request", "Score"]
PROGRESS_MIN_ROWS = 32


class InferenceEngine:
    """Prompts in, completions out, through veRL's rollout contract on one backend (`local`, `sglang`,
    `tokasaurus`): the only composition root of final.

    `generate` / `agenerate` (and `score` / `ascore`) check the whole call first (typed errors from final.errors
    name the cause), then run it on the backend and return a `GenerationOutput` (or `Score`s). `prepare` + `run`
    split the two (what `final serve` does). Cartridges (`load_cartridge`, `cartridge=`), tools (the config's
    `rollout.multi_turn`) and weight updates (`update_weights`, `release`, `resume`) are served on every backend
    that declares them. Use it as a context manager, or call `shutdown()`.
    """

    def __init__(self, config: str | Path | dict | None = None, **overrides: Any):
        """config: a YAML file or a dict; None: $FINAL_CONFIG, else ./config.yaml, else the package's default.
        Keyword overrides are deep-merged on top (same shape as the file)."""
        self.config: EngineConfig = load_config(config, overrides)
        self.backend = self.config.backend
        backend_class(self.backend, self.config.source).preflight(self.config)  # before any model download
        self.model_dir = resolve_model_path(self.config.model_path)
        self.max_model_len = self.config.check_against_model(self.model_dir)
        self.rollout_config = self.config.rollout_config()
        self.model_config = self.config.model_config(self.model_dir)
        self.rollout: Backend = build_backend(self.config, self.rollout_config, self.model_config)
        self._closed = False
        self._side: RolloutThread | None = None  # for blocking calls made inside a running event loop
        self._admission = Admission(self.config.limits.max_queued_rows)  # rows of calls in flight, bounded
        self._weights = WeightSync(self.backend, self.rollout, self._complete)  # updates, versions, sleep mode
        try:
            self.capabilities = self.rollout.capabilities
            self.tokenizer = getattr(self.model_config.tokenizer, "tokenizer", self.model_config.tokenizer)
            self.pad_token_id = self.rollout.pad_token_id
            self.eos_token_ids = eos_token_ids(self.model_dir, self.tokenizer)
            self.cartridges = self._weights.cartridges = self._cartridge_service()
            self._tool_schemas = self.rollout.tool_schemas()  # fixed at start (tools.yaml)
        except BaseException:
            self.rollout.shutdown()
            raise
        _live.add(self)

    # ---- public API ----------------------------------------------------------------------------------
    @property
    def engine(self) -> Any:
        """The embedded engine when the backend is local (else None): for building cartridges and benchmarks."""
        target = self.rollout.cartridge_target
        return target if isinstance(target, EmbeddedEngine) else None

    def generate(self, prompts: Any, *, on_event: Callable[[dict], None] | None = None,
                 **options: Any) -> GenerationOutput:
        """Generate for a str, list[str], a message list, a list of message lists, or token ids.

        options: prepare()'s keywords and the sampling keys (seed 003 plus ours): temperature, top_p, top_k, min_p,
        max_tokens, n, do_sample, seed, stop, stop_token_ids, ignore_eos, logprobs, presence_penalty,
        frequency_penalty, repetition_penalty, min_new_tokens; top_logprobs=k (metadata "top_logprobs": the k most
        likely (token id, logprob) at each generated token); prompt_logprobs=True (metadata "prompt_logprobs": every
        prompt token's; max_tokens may then be 0); json_schema, regex, ebnf or structural_tag (a constraint).
        on_event sees each tool call and result of a multi-turn call as it happens."""
        return self.run(self.prepare(prompts, **options), on_event=on_event)

    async def agenerate(self, prompts: Any, *, on_event: Callable[[dict], None] | None = None,
                        **options: Any) -> GenerationOutput:
        """Awaitable generate(); safe inside a running event loop (a Jupyter cell, a server)."""
        return await self.arun(self.prepare(prompts, **options), on_event=on_event)

    def score(self, prompts: Any, continuations: Any = None, *, top_logprobs: int = 0, cartridge: Any = None,
              raw: bool = False, chat_template_kwargs: dict | None = None) -> list[Score]:
        """Log-probs of given text: per prompt, every token's log p(token | tokens before it) in one forward pass,
        nothing generated. continuations: one per prompt (text, token ids, or None), appended to the prompt's
        tokens; Score.logprob sums the continuation's and Score.is_greedy says whether greedy decoding would
        produce it (lm-eval's loglikelihood). top_logprobs=k adds the k most likely tokens at every position.
        Prompts take generate()'s shapes (text gets the chat template unless raw=True); with a cartridge the
        scores are conditional on it, at the positions generation uses. chat_template_kwargs: template variables."""
        request = self.prepare_score(prompts, continuations, top_logprobs=top_logprobs, cartridge=cartridge, raw=raw,
                                     chat_template_kwargs=chat_template_kwargs)
        return request.scores(self.run(request).metadata)

    async def ascore(self, prompts: Any, continuations: Any = None, *, top_logprobs: int = 0, cartridge: Any = None,
                     raw: bool = False, chat_template_kwargs: dict | None = None) -> list[Score]:
        """Awaitable score(); safe inside a running event loop."""
        request = self.prepare_score(prompts, continuations, top_logprobs=top_logprobs, cartridge=cartridge, raw=raw,
                                     chat_template_kwargs=chat_template_kwargs)
        return request.scores((await self.arun(request)).metadata)

    def prepare_score(self, prompts: Any, continuations: Any = None, *, top_logprobs: int = 0, cartridge: Any = None,
                      raw: bool = False, chat_template_kwargs: dict | None = None) -> Request:
        """score()'s checks and tokenization, nothing run (score() = prepare_score + run + Request.scores)."""
        self._require_open()
        return prepare_score(prompts, continuations, self.rules, top_logprobs=top_logprobs, raw=raw,
                             cartridge=cartridge, chat=template_call(chat_template_kwargs))

    def prepare(self, prompts: Any, *, cartridge: Any = None, tools_kwargs: Any = None, raw: bool = False,
                progress: bool | None = None, adapter: Any = None, tools: Any = None, tool_choice: Any = None,
                parallel_tool_calls: bool | None = None, response_format: dict | None = None,
                chat_template_kwargs: dict | None = None, max_turns: int | None = None, **sampling: Any) -> Request:
        """Validate and tokenize a call without running it (generate() = prepare + run; the server uses both); the
        typed errors of final.errors, raised before anything runs. adapter: a LoRA adapter's name (or one per prompt).
        tools, tool_choice, parallel_tool_calls, max_turns, response_format, chat_template_kwargs: the tool-calling
        guide (docs/guides/tool-calling.md); rows' calls in GenerationOutput.tool_calls, reasoning in .reasoning."""
        self._require_open()
        return prepare_call(prompts, self.rules, Reading.of(self.config), sampling=sampling, raw=raw,
                            cartridge=cartridge, tools_kwargs=tools_kwargs, progress=progress, adapter=adapter,
                            chat={"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls,
                                  "response_format": response_format, "chat_template_kwargs": chat_template_kwargs,
                                  "max_turns": max_turns})

    @property
    def rules(self) -> CallRules:
        """What preparing a call needs to know of this engine (final.request.CallRules)."""
        rollout = self.rollout_config
        return CallRules(self.tokenizer, rollout.prompt_length, rollout.response_length, self.config.limits,
                         self.backend, self.capabilities,
                         self.tool_names() if rollout.multi_turn.enable else None, self.cartridge_ids,
                         self._known_cartridges, self.config.progress, PROGRESS_MIN_ROWS, self.adapter_names)

    def run(self, request: Request, *, on_event: Callable[[dict], None] | None = None) -> GenerationOutput:
        """Run a prepared request and wait. Raises OverloadedError when limits.max_queued_rows are taken, and
        DeadlineError past limits.deadline_s."""
        if loop_running():  # veRL's blocking calls refuse a running loop (a notebook cell): run on a side thread
            return self._side_thread().run(self.run, request, on_event=on_event)
        if self.config.limits.deadline_s is not None:  # a deadline needs a wait it can cancel: the awaitable path
            return asyncio.run(self.arun(request, on_event=on_event))
        with self._admission.hold(request.rows), self._weights.reading() as version, \
                holding(self.cartridges, request) as carts, CallObserver.open(request, on_event) as observer:
            data = request.dataproto(self.pad_token_id, self.eos_token_ids, carts)
            out = self.rollout.generate_sequences(data, observer=observer, **request.sampling.params)
        return self._output(request, out, version)

    async def arun(self, request: Request, *, on_event: Callable[[dict], None] | None = None) -> GenerationOutput:
        """Run a prepared request from a running event loop; cancelling it (or its deadline) aborts its rows."""
        with self._admission.hold(request.rows):
            return await within_deadline(self._arun(request, on_event), self.config.limits.deadline_s)

    async def _arun(self, request: Request, on_event: Callable[[dict], None] | None) -> GenerationOutput:
        async with self._weights.areading() as version, aholding(self.cartridges, request) as carts:
            with CallObserver.open(request, on_event) as observer:
                data = request.dataproto(self.pad_token_id, self.eos_token_ids, carts)
                out = await self.rollout.agenerate_sequences(data, observer=observer, **request.sampling.params)
        return self._output(request, out, version)

    async def astream(self, request: Request) -> AsyncIterator[Completion]:
        """Row updates of a prepared request as they come (every token where capabilities.streaming, else each
        row once, complete). Rows are indexed prompt-major; a row's last update has its finish_reason. A row the
        engine aborted raises SequenceError; closing the iterator early aborts the request's rows."""
        with self._admission.hold(request.rows):
            async with self._weights.areading() as version, aholding(self.cartridges, request) as carts:
                data = request.dataproto(self.pad_token_id, self.eos_token_ids, carts)
                updates = self.rollout.astream(data, **request.sampling.params)
                try:
                    async for row in until_deadline(updates, self.config.limits.deadline_s):
                        raise_if_aborted([row])
                        row = row.without_output() if request.sampling.max_new_tokens == 0 else row
                        yield dataclasses.replace(row, weights_version=version)
                finally:
                    await updates.aclose()

    def tool_names(self) -> list[str]:
        """The names of the tools this engine offers (from tools.yaml; empty without multi-turn)."""
        return [s["function"]["name"] for s in self.tool_schemas()]

    def tool_schemas(self) -> list[dict]:
        """The OpenAI schemas of the tools a multi-turn call offers by default (tools.yaml's)."""
        return list(self._tool_schemas)

    def text(self, completion: Completion, request: Request) -> str:
        """What a user reads of a row: up to the first eos, special tokens skipped (but those marking tool calls or
        reasoning, for a call that reads them), cut before a stop string."""
        params = request.sampling.params
        return completion_text(self.tokenizer, completion.output_ids,
                               eos_ids=set(self.eos_token_ids) | set(params.get("stop_token_ids") or []),
                               stop=request.sampling.stop, ignore_eos=bool(params.get("ignore_eos")),
                               keep_ids=request.chat.keep_ids if request.chat is not None else ())

    def load_cartridge(self, id: str | None = None, source: str = "local", path: str | None = None,  # noqa: A002
                       force_redownload: bool = False, pin: bool = False, positions: str | None = None) -> str:
        """Load a cartridge (file checked against its manifest and the model) and return its id.
        positions: after_prefix | from_zero, the convention it was trained with (None: its manifest or run
        config.yaml says, else after_prefix); see final.cartridges.positions."""
        return self._require_cartridges().load(id=id, source=source, path=path,
                                               force_redownload=force_redownload, pin=pin, positions=positions)

    def unload_cartridge(self, cartridge_id: str) -> bool:
        """Forget a cartridge; requests already running with it finish normally."""
        return self._require_cartridges().unload(cartridge_id)

    # ---- weights (RL: the policy a trainer updates) -------------------------------------------------------------
    def update_weights(self, weights: Any, *, keep_cartridges: bool = False, peft_config: Any = None) -> int:
        """Serve new weights; returns the new weights_version.

        weights: an nn.Module (its state dict), a state dict, an iterable of (HF parameter name, tensor) -
        veRL's generator, consumed whole first - or a path to an HF folder / .safetensors file. A subset of the
        parameters is a valid update; a LoRA adapter (PEFT folder, PeftModel, or lora tensors + peft_config) is
        merged into its kept base (final.adapters.merge). The whole update is checked before any write (WeightsError
        names the parameter: unknown, wrong shape, not float, NaN/Inf); the old weights then keep serving.
        Calls in flight finish on the old weights first; calls made meanwhile wait and run on the new ones.
        Loaded cartridges were made for the old weights: they are unloaded, and requests naming them are refused
        until they are loaded again; keep_cartridges=True keeps serving them (stale). A released engine resumes."""
        self._require_open()
        return self._weights.update(weights, keep_cartridges=keep_cartridges, peft_config=peft_config)

    async def aupdate_weights(self, weights: Any, *, keep_cartridges: bool = False, peft_config: Any = None) -> int:
        """update_weights() from an event loop (a server): the wait and the write run on a worker thread."""
        return await off_loop(self.update_weights, weights, keep_cartridges=keep_cartridges, peft_config=peft_config)

    def load_adapter(self, path: str | Path, name: str | None = None) -> str:
        """Serve a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) to calls naming it
        (generate(adapter=name), `final serve`'s `model`); name: default the folder's. Returns the name."""
        self._require_open()
        self.rollout.load_adapter(name := adapter_name(path, name), str(path))
        return name

    def unload_adapter(self, name: str) -> bool:
        """Forget a loaded adapter (calls running with it finish with it); False if none had that name."""
        return self.rollout.unload_adapter(name)

    def adapter_names(self) -> list[str]:
        """The loaded adapters' names (what generate(adapter=...) and the OpenAI `model` field may name)."""
        return self.rollout.adapter_names()

    @property
    def weights_version(self) -> int:
        """How many weight updates this engine has applied; every output row's metadata says the one it ran on."""
        return self._weights.version

    def release(self) -> None:
        """veRL's sleep mode: once the calls in flight finish, free what can be rebuilt (the KV pool; on SGLang
        with its memory saver, the weights too) while a trainer needs the memory. The next call resumes."""
        self._require_open()
        self._weights.release()

    def resume(self, tags: list[str] | None = None) -> None:
        """Bring back what release() freed (veRL's tags "weights", "kv_cache"; None: both)."""
        self._require_open()
        self._weights.resume(tags)

    def _complete(self, coro: Any) -> Any:
        """A backend coroutine run to its end from a blocking caller (from a running loop: on the side thread)."""
        if loop_running():
            return self._side_thread().run(asyncio.run, coro)
        return asyncio.run(coro)

    def _require_open(self) -> None:
        if self._closed:
            raise EngineError("this InferenceEngine has been shut down")

    def shutdown(self) -> None:
        """Stop the backend (its engine thread or processes) and free the model; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        try:
            self.rollout.shutdown()
        finally:
            if self._side is not None:
                self._side.close()

    def __enter__(self) -> "InferenceEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- results ---------------------------------------------------------------------------------------
    def _output(self, request: Request, out: Any, version: int) -> GenerationOutput:
        n = request.n
        where = [{"prompt_index": i // n, "sample_index": i % n, "weights_version": version}
                 for i in range(len(out))]
        if "messages" in out.non_tensor_batch:  # multi-turn: whole conversations, tool turns included
            conv = conversation_rows(out, self.tokenizer)
            infos = out.non_tensor_batch[ROW_INFO]
            meta = [{**r.to_metadata(), "finish_reason": info["finish_reason"], "prompt_tokens": info["prompt_tokens"],
                     "cached_tokens": info["cached_tokens"], **w} for r, info, w in zip(conv, infos, where)]
            return read_output(GenerationOutput([r.final_text for r in conv], [r.response_ids for r in conv], meta, n),
                               request.reply)
        rows = completions_of(out)
        raise_if_aborted(rows)
        if request.sampling.max_new_tokens == 0:
            rows = [r.without_output() for r in rows]
        prompt_width = out.batch["prompts"].shape[1]
        meta = []
        for r, w in zip(rows, where):
            mask = out.batch["attention_mask"][r.index, prompt_width:prompt_width + r.completion_tokens].tolist()
            m = {"response_ids": r.output_ids, "response_mask": mask, "finish_reason": r.finish_reason,
                 "matched": r.matched, "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                 "completion_tokens": r.completion_tokens, **w, **self._logprobs(r, request.sampling)}
            meta.append(m)
        return read_output(GenerationOutput([self.text(r, request) for r in rows], [r.output_ids for r in rows], meta,
                                            n), request.reply)

    def _logprobs(self, row: Completion, sampling: Any) -> dict[str, Any]:
        """The logprob entries of a row's metadata that the call asked for (final.sampling.Sampling)."""
        values = row.logprobs
        if sampling.logprobs and (values is None or len(values) != row.completion_tokens
                                  or any(v != v for v in values)):  # NaN: missing
            raise EngineError(f"the {self.backend} backend returned no logprobs for row {row.index} (a Tokasaurus "
                              "server needs enable_chosen_logprobs=True)")
        m: dict[str, Any] = {"logprobs": list(values)} if sampling.logprobs else {}
        if sampling.top_logprobs:
            m["top_logprobs"] = [t[:sampling.top_logprobs] for t in row.top_logprobs or []]
        if sampling.prompt_logprobs:
            m["prompt_logprobs"] = row.prompt_logprobs
            if sampling.top_logprobs:
                m["prompt_top_logprobs"] = row.prompt_top_logprobs
        return m

    # ---- cartridges ------------------------------------------------------------------------------------
    def _cartridge_service(self):
        """A store for cartridges where the backend holds their KV (the embedded engine, SGLang's radix cache)."""
        target = self.rollout.cartridge_target
        if target is None:
            return None
        service = CartridgeService(target, model=self.model_dir, cache_dir=cache_dir() / "cartridges",
                                   budget_bytes=self.config.limits.max_cartridge_bytes,
                                   fetch_timeout_s=self.config.limits.cartridge_fetch_s)
        for spec in self.config.cartridges:
            service.load(**spec)
        return service

    def _require_cartridges(self):
        if self.cartridges is None:
            raise CartridgeError(f"the {self.backend} backend serves no cartridges from this process "
                                 "(use the local or sglang backend)", field="backend")
        return self.cartridges

    def facts(self) -> dict:
        """What a pool of replicas (final.pool) needs to prepare calls for this engine."""
        return {"backend": self.backend, "capabilities": self.capabilities, "eos_token_ids": self.eos_token_ids,
                "pad_token_id": self.pad_token_id, "tool_schemas": self.tool_schemas(),
                "cartridge_ids": self.cartridge_ids()}

    def cartridge_ids(self) -> list[str] | None:
        """Ids of the cartridges loaded here (None: this backend keeps no cartridge store)."""
        return self.cartridges.ids() if self.cartridges is not None else None

    def cartridge_usage(self) -> dict | None:
        """Each loaded cartridge (id, bytes, pinned, the references requests hold on it now) and the store's
        counters (loads, evictions, hits, misses); None when this backend keeps no cartridge store."""
        if self.cartridges is None:
            return None
        entries = [self.cartridges.store.get(cid) for cid in self.cartridges.ids()]
        return {"cartridges": [{"id": e.cartridge_id, "bytes": e.nbytes, "pinned": e.pinned, "refcount": e.refcount}
                               for e in entries if e is not None],
                "metrics": dataclasses.asdict(self.cartridges.metrics())}

    def _known_cartridges(self) -> list[str] | None:
        """Ids a request may name: loaded ones, and those a weight update retired (refused with that reason)."""
        if self.cartridges is None:
            return self.rollout.cartridge_ids()
        return self.cartridge_ids() + self.cartridges.retired_ids()

    def _side_thread(self) -> RolloutThread:
        if self._side is None:
            self._side = RolloutThread("final-call")
        return self._side


def local_engine(model: str, *, dtype: str = "auto", device: str = "cpu", max_num_seqs: int = 256,
                 progress: bool = False, prefix_cache: bool = True) -> InferenceEngine:
    """An InferenceEngine on the embedded engine over the model's whole context window: what the tools that work
    on the engine itself build on (cartridge build/verify, benchmarks); its `.engine` is the EmbeddedEngine.
    prefix_cache=False: every request prefills its whole prompt (benchmarks that repeat one)."""
    positions = model_positions(resolve_model_path(model))
    response = min(512, positions // 4)
    return InferenceEngine({"model_path": model, "progress": progress, "rollout": {
        "name": "local", "dtype": dtype, "max_num_seqs": max_num_seqs, "prompt_length": positions - response,
        "response_length": response, "engine_kwargs": {"local": {"device": device, "prefix_cache": prefix_cache}}}})


_live: "weakref.WeakSet[InferenceEngine]" = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    # Engines left open at interpreter exit would otherwise hold threads and (on GPU) device memory.
    for engine in list(_live):
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
