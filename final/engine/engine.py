"""EmbeddedEngine: the subset of SGLang 0.5.2's `Engine` that veRL uses, in plain PyTorch.

One background thread (final/engine/core.py) owns the model, the KV cache and the running batch; callers on any
thread or event loop make requests here, which are validated on the caller's thread and then sent in one typed
message. Requests join the running batch between steps and leave it when they finish (continuous batching).
Beyond SGLang it serves cartridges (per-request prefilled KV prefixes) and `submit`, a batch call that returns a
concurrent future and can run a `finish` function over all the outputs on the engine thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import uuid
from typing import Any, AsyncIterator, Callable, Sequence as Seq

import torch

from final.adapters.format import Adapter
from final.engine.core import EngineCore
from final.engine.grammar import GrammarCompiler
from final.engine.kv_cache import PrefixKV
from final.engine.messages import Abort, Batch, Call, Drain, Stop, Submission, Submit
from final.engine.model import CausalLM
from final.engine.runner import ModelRunner
from final.engine.sampling_params import SamplingParams
from final.engine.sequence import Sequence
from final.engine.weights import current_weights, parameter_shapes
from final.errors import CartridgeError, EngineError, PromptError, SamplingError
from final.models import model_eos_token_ids

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # fp32 on CPU: HF's numbers to ~1e-4 (sums in another order); bf16 on CUDA as SGLang does.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise EngineError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


class EmbeddedEngine:
    def __init__(self, model_path: str, *, dtype: str | torch.dtype = "auto", device: str = "cpu",
                 max_running_requests: int = 256, max_model_len: int | None = None,
                 max_prefill_tokens: int = 8192, mem_fraction_static: float = 0.5,
                 random_seed: int | None = None, eos_token_ids: Seq[int] | None = None,
                 quantization: str | None = None):
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model_path = model_path
        self.quantization = quantization  # None (the model dtype), "int8" or "bf16" (CPU; model.check_quantization)
        self._closed = False
        self._rng = random.Random(random_seed)
        eos = frozenset(eos_token_ids if eos_token_ids is not None else model_eos_token_ids(model_path))
        # The model is loaded (and its weights packed) on the engine thread, which then does all of the engine's
        # tensor work. On CPU this matters: every OS thread that runs parallel torch ops keeps its own OpenMP team,
        # and once teams outnumber the cores libgomp stops spinning between parallel regions - measured 30% slower
        # decode when the thread that built the model stayed alive (bench/RESULTS.md).
        started: concurrent.futures.Future = concurrent.futures.Future()
        options = dict(max_running_requests=max_running_requests, max_model_len=max_model_len,
                       max_prefill_tokens=max_prefill_tokens, mem_fraction_static=mem_fraction_static,
                       eos_token_ids=eos)
        self._thread = threading.Thread(target=self._main, args=(started, options), name="final-engine",
                                        daemon=True)
        self._thread.start()
        self.core: EngineCore = started.result()
        # constraints (json_schema, regex, ebnf, structural_tag) compile on the callers' threads, once per text
        self.grammars = GrammarCompiler(model_path, self.core.spec.vocab_size, eos)

    def _main(self, started: concurrent.futures.Future, options: dict) -> None:
        try:
            model = CausalLM.from_pretrained(self.model_path, self.dtype, self.device, self.quantization)
            max_len = options.pop("max_model_len") or model.spec.max_position_embeddings
            core = EngineCore(model, self.model_path, max_model_len=min(max_len, model.spec.max_position_embeddings),
                              **options)
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor, which raises it
            started.set_exception(exc)
            return
        started.set_result(core)
        core.run()

    def __getattr__(self, name: str) -> Any:
        """The engine thread's state (model, spec, max_model_len, cache, prefixes, scheduler, runner, stats, ...),
        for inspection: read what changes on that thread with engine.call(...)."""
        core = self.__dict__.get("core")
        if core is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(core, name)

    # ---- SGLang dialect ------------------------------------------------------------------------------
    async def async_generate(self, prompt: Any = None, sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, image_data: Any = None,
                             return_logprob: bool | list[bool] = False, logprob_start_len: int | list[int] | None = None,
                             top_logprobs_num: int | None = None, rid: str | list[str] | None = None,
                             stream: bool = False, cartridges: Seq[str] | list[Seq[str]] | None = None,
                             adapters: str | list[str | None] | None = None,
                             **unsupported: Any) -> dict | list[dict] | AsyncIterator[dict]:
        """Generate for one prompt (list[int]) or a batch (list[list[int]]); returns SGLang-shaped dict(s).
        adapters: a loaded LoRA adapter's name for every prompt, or one name (or None) per prompt (SGLang's
        lora_path).

        stream=True (one prompt, n=1) returns an async iterator instead, as SGLang does: one dict per new token
        with the cumulative output_ids (SGLang's default without --stream-output), the last with finish_reason."""
        if unsupported:
            raise TypeError(f"async_generate() got unsupported arguments: {sorted(unsupported)}")
        if prompt is not None:
            raise PromptError("the embedded engine is token-in-token-out (skip_tokenizer_init): pass input_ids")
        if image_data is not None and any(x is not None for x in (image_data if isinstance(image_data, list)
                                                                   else [image_data])):
            raise PromptError("the embedded engine is text-only; image_data must be None")
        single = bool(input_ids) and isinstance(input_ids[0], int)
        seqs = self.sequences(input_ids, sampling_params, return_logprob=return_logprob,
                              logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num, rid=rid,
                              cartridges=cartridges, adapters=adapters)
        if stream:
            if len(seqs) != 1:
                raise SamplingError("streaming takes one prompt with n=1", "stream")
            return self._stream(seqs[0])
        outs = await self.submit(seqs).wait()
        return outs[0] if single and len(outs) == 1 else outs

    def generate(self, input_ids: list[int] | list[list[int]], sampling_params: dict | list[dict] | None = None,
                 **kwargs: Any) -> dict | list[dict]:
        """Blocking form of async_generate (for scripts; from a running event loop use async_generate)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.async_generate(input_ids=input_ids, sampling_params=sampling_params, **kwargs))
        raise EngineError("generate() was called inside a running event loop; await async_generate() instead")

    def flush_cache(self) -> bool:
        """SGLang clears its radix cache here. We keep no prompt cache (compositions of cartridges are dropped
        when their last row finishes), so there is nothing to clear."""
        return True

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self._post(Abort(rid, abort_all))

    def release_memory_occupation(self) -> None:
        """Free the KV pool (veRL's release()) once the running rows have finished; it is rebuilt on the next
        request."""
        self.drain(lambda _runner: self.core.release_memory())

    # ---- weights ------------------------------------------------------------------------------------
    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF parameter name this engine holds, with its shape: what an update may name."""
        return parameter_shapes(self.core.model)

    def update_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Write HF-named tensors (checked first: final.weights.check_update against parameter_shapes) into the
        engine's layout, once the rows already admitted have finished; rows submitted meanwhile wait and run on
        the new weights. Returns the engine's new weight_version (each row's meta_info says the one it ran on)."""
        return self.drain(lambda _runner: self.core.update_weights(named))

    def current_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Copies of HF-named parameters as served now (the base an adapter is merged into)."""
        return self.call(lambda _runner: current_weights(self.core.model, names))

    # ---- LoRA adapters served per row (engine/lora.py) ----------------------------------------------------
    def load_adapter(self, name: str, adapter: Adapter) -> int:
        """Serve a checked adapter (final.adapters.build_adapter against parameter_shapes) to requests naming it;
        a name already loaded is replaced (rows running with the old one finish with it). Returns its bytes."""
        return self.call(lambda _runner: self.core.adapters.add(name, adapter).nbytes)

    def unload_adapter(self, name: str) -> bool:
        """Forget an adapter; rows running with it finish with it."""
        return self.call(lambda _runner: self.core.adapters.remove(name))

    def adapter_names(self) -> list[str]:
        return self.core.adapters.names()

    @property
    def weight_version(self) -> int:
        return self.core.weight_version

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.core.inbox.put(Stop())
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)

    # ---- batches -------------------------------------------------------------------------------------
    def sequences(self, input_ids: Any, sampling_params: Any = None, *, return_logprob: Any = False,
                  logprob_start_len: Any = None, top_logprobs_num: Any = None, rid: Any = None,
                  cartridges: Any = None, adapters: Any = None) -> list[Sequence]:
        """Validate SGLang-style arguments (one value or one per prompt) into sequences, n expanded
        prompt-major. Raises PromptError / SamplingError / CartridgeError naming the prompt and field."""
        batch = [input_ids] if bool(input_ids) and isinstance(input_ids[0], int) else input_ids
        if not isinstance(batch, list) or not batch:
            raise PromptError("input_ids must be a non-empty list of token ids or a list of such lists")
        n = len(batch)
        params = [SamplingParams.from_dict(p) for p in _per_item(sampling_params, n, "sampling_params")]
        flags, starts = _per_item(return_logprob, n, "return_logprob"), _per_item(logprob_start_len, n,
                                                                                  "logprob_start_len")
        rids, carts = _per_item(rid, n, "rid"), _per_cartridge(cartridges, n)
        names = _per_item(adapters, n, "adapters")
        for name in {a for a in names if a is not None}:
            self.core.adapters.get(name)  # AdapterError naming what is loaded
        tops = [self._top_logprobs_num(k) for k in _per_item(top_logprobs_num, n, "top_logprobs_num")]
        seqs = [self._make_sequence(i, ids, params[i], j, bool(flags[i]), -1 if starts[i] is None else starts[i],
                                    rids[i], carts[i], names[i])
                for i, ids in enumerate(batch) for j in range(params[i].n)]
        for seq, k in zip(seqs, [k for i, k in enumerate(tops) for _ in range(params[i].n)]):
            seq.top_logprobs_num = k if seq.return_logprob else 0  # SGLang: alternatives come with return_logprob
        return seqs

    def submit_generate(self, input_ids: Any, sampling_params: Any = None, *, return_logprob: Any = False,
                        logprob_start_len: Any = None, top_logprobs_num: Any = None, rid: Any = None,
                        cartridges: Any = None, adapters: Any = None,
                        finish: Callable[[list[dict]], Any] | None = None,
                        on_row: Callable[[int, dict], None] | None = None) -> Submission:
        """async_generate's batch form for callers without an event loop: validate now, send the rows in one
        message, and return at once. The submission's future resolves when every row has finished, with their
        output dicts in order, or with finish(outputs) run on the engine thread; on_row(i, out) sees each row."""
        seqs = self.sequences(input_ids, sampling_params, return_logprob=return_logprob,
                              logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num, rid=rid,
                              cartridges=cartridges, adapters=adapters)
        return self.submit(seqs, finish, on_row)

    def submit(self, seqs: list[Sequence], finish: Callable[[list[dict]], Any] | None = None,
               on_row: Callable[[int, dict], None] | None = None) -> Submission:
        batch = Batch(len(seqs), finish, on_row)
        for row, seq in enumerate(seqs):
            seq.batch, seq.row = batch, row
        self._post(Submit(seqs))
        rids = frozenset(s.rid for s in seqs)  # one message: every row leaves at the same step boundary
        return Submission(batch.future, lambda: None if self._closed else self._post(Abort(rids=rids)))

    # ---- cartridges ----------------------------------------------------------------------------------
    def load_cartridge(self, cartridge_id: str, keys: list[torch.Tensor], values: list[torch.Tensor]) -> PrefixKV:
        """Make a cartridge available to requests: per-layer K/V [1,Hkv,T,D] or [Hkv,T,D], post-RoPE."""
        if not isinstance(cartridge_id, str) or not cartridge_id:
            raise CartridgeError("cartridge id must be a non-empty string", field="id")
        # the device/dtype copy runs on the engine thread (the one thread that does tensor work)
        return self.call(lambda _runner: self.core.prefixes.add(cartridge_id, keys, values))

    def unload_cartridge(self, cartridge_id: str) -> bool:
        """Remove a cartridge; running requests that use it finish normally (they hold their own reference)."""
        return self.core.prefixes.remove(cartridge_id)

    def cartridge_ids(self) -> list[str]:
        return self.core.prefixes.ids()

    # ---- running work on the engine thread -----------------------------------------------------------
    def call(self, fn: Callable[[ModelRunner], Any]) -> Any:
        """Run fn(runner) on the engine thread between steps and return its result (e.g. building a cartridge)."""
        if threading.current_thread() is self._thread:
            return fn(self.core.runner)
        msg = Call(fn)
        self._post(msg)
        return msg.future.result()

    def drain(self, fn: Callable[[ModelRunner], Any]) -> Any:
        """call(fn), but once no row is running or waiting: rows admitted before finish first, rows submitted
        meanwhile wait and run after it (messages.Drain). From another thread only: it waits for this one."""
        if threading.current_thread() is self._thread:
            raise EngineError("drain() waits for the engine thread's rows: call it from another thread")
        msg = Drain(fn)
        self._post(msg)
        return msg.future.result()

    # ---- internals -----------------------------------------------------------------------------------
    def _post(self, msg: Any) -> None:
        if self._closed:
            raise EngineError("the engine has been shut down")
        if not self._thread.is_alive():
            raise EngineError("the engine thread is not running")
        self.core.inbox.put(msg)

    def _make_sequence(self, index: int, ids: Any, params: SamplingParams, sample_index: int, return_logprob: bool,
                       logprob_start_len: int, rid: str | None, cartridges: tuple[str, ...],
                       adapter: str | None = None) -> Sequence:
        spec, max_len = self.core.spec, self.core.max_model_len
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise PromptError("input_ids must be a non-empty list of integers", index)
        bad = [t for t in ids if not 0 <= t < spec.vocab_size]
        if bad:
            raise PromptError(f"token ids {bad[:5]} are outside the vocabulary [0, {spec.vocab_size})", index)
        if any(t >= spec.vocab_size for t in params.stop_token_ids):  # they would index past the logits
            raise SamplingError(f"token ids outside the vocabulary [0, {spec.vocab_size})", "stop_token_ids")
        prefix_len = self.core.prefixes.length_of(cartridges)
        context = len(ids) + prefix_len
        room = max_len + (params.max_new_tokens == 0)  # scoring only (nothing generated): the whole window is prompt
        if context >= room and prefix_len and len(ids) < max_len:
            raise CartridgeError(f"prompt {index}: {context} tokens (cartridge {prefix_len} + prompt {len(ids)}) do "
                                 f"not fit the context window of {max_len} (max_model_len)",
                                 file=",".join(cartridges), field="max_model_len")
        if context >= room:
            raise PromptError(f"{context} tokens (prompt {len(ids)} + cartridge {prefix_len}) do not fit the "
                              f"context window of {max_len} (max_model_len)", index)
        if logprob_start_len >= len(ids):
            raise SamplingError(f"{logprob_start_len} must be below the prompt length {len(ids)}", "logprob_start_len")
        seed = splitmix64(params.seed + sample_index) if params.seed is not None else self._rng.randrange(2**63)
        seq = Sequence(
            rid=(rid if params.n == 1 else f"{rid}-{sample_index}") if rid else uuid.uuid4().hex,
            prompt_ids=list(ids), params=params,
            max_new_tokens=max(0, min(params.max_new_tokens, max_len - context - 1)),
            stop_ids=frozenset() if params.ignore_eos else self.core.eos_token_ids | frozenset(params.stop_token_ids),
            generator=None if params.greedy else torch.Generator(device="cpu").manual_seed(seed),
            cartridges=cartridges, prefix_len=prefix_len, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, adapter=adapter,
            grammar=self.grammars.row(*params.constraint) if params.constraint else None)
        if self.core.scheduler.too_big(seq):
            raise PromptError(f"needs {seq.reserved_tokens} tokens of KV memory, more than the engine's budget", index)
        return seq

    def _top_logprobs_num(self, k: Any) -> int:
        if k is None:
            return 0
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.core.spec.vocab_size:
            raise SamplingError(f"must be an integer in [0, {self.core.spec.vocab_size}], got {k!r}",
                                "top_logprobs_num")
        return k

    async def _stream(self, seq: Sequence) -> AsyncIterator[dict]:
        """Yield seq's output after every token; closing the iterator early aborts the request."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()

        def put(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(chunks.put_nowait, item)
            except RuntimeError:  # the consumer's loop is closed
                pass

        seq.on_token = lambda s: put(s.to_output())  # snapshot taken on the engine thread
        future = self.submit([seq], on_row=lambda _row, out: put(out)).future
        future.add_done_callback(lambda f: not f.cancelled() and f.exception() is not None and put(f.exception()))
        finished = False
        try:
            while not finished:
                item = await chunks.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item["meta_info"]["finish_reason"] is not None
                yield item
        finally:
            if not finished and not self._closed:
                self.abort_request(seq.rid)


def splitmix64(x: int) -> int:
    """Well-mixed 63-bit seed from an integer, so seeds s and s+1 give unrelated random streams."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 1


def _per_item(value: Any, n: int, name: str) -> list:
    """SGLang batch arguments: one value for all prompts, or a list with one value per prompt."""
    if isinstance(value, list):
        if len(value) != n:
            raise SamplingError(f"has {len(value)} entries for {n} prompts", name)
        return value
    return [value] * n


def _per_cartridge(cartridges: Any, n: int) -> list[tuple[str, ...]]:
    if cartridges is None or (isinstance(cartridges, (list, tuple)) and not cartridges):
        return [()] * n
    if isinstance(cartridges, str):
        return [(cartridges,)] * n
    items = list(cartridges)
    if items and all(isinstance(c, str) for c in items):
        return [tuple(items)] * n
    if len(items) != n:
        raise CartridgeError(f"has {len(items)} entries for {n} prompts", field="cartridges")
    return [() if c is None else (c,) if isinstance(c, str) else tuple(c) for c in items]
