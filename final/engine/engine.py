"""EmbeddedEngine: the subset of SGLang 0.5.2's `Engine` that veRL uses, in plain PyTorch.

One background thread owns the model, the KV cache and the running batch; callers on any thread or event loop
submit requests and await their futures. Requests join the running batch between steps and leave it when they
finish (continuous batching). Beyond SGLang it serves cartridges: per-request prefilled KV prefixes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import random
import threading
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any, AsyncIterator, Callable, Sequence as Seq

import torch

from final.engine.kv_cache import KVCache, PrefixKV, PrefixTable
from final.engine.model import CausalLM
from final.engine.runner import ModelRunner
from final.engine.sampler import sample
from final.engine.sampling_params import SamplingParams
from final.engine.scheduler import Scheduler
from final.engine.sequence import Sequence
from final.errors import CartridgeError, EngineError, PromptError, SamplingError
from final.models import model_eos_token_ids

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # fp32 on CPU keeps exact parity with HF; bf16 on CUDA as SGLang does.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise EngineError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def total_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class EngineStats:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    aborted: int = 0


class EmbeddedEngine:
    def __init__(self, model_path: str, *, dtype: str | torch.dtype = "auto", device: str = "cpu",
                 max_running_requests: int = 256, max_model_len: int | None = None,
                 max_prefill_tokens: int = 8192, mem_fraction_static: float = 0.5,
                 random_seed: int | None = None, eos_token_ids: Seq[int] | None = None):
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model_path = model_path
        self._inbox: queue.Queue = queue.Queue()
        self._closed = False
        # The model is loaded (and its weights packed) on the engine thread, which then does all of the engine's
        # tensor work. On CPU this matters: every OS thread that runs parallel torch ops keeps its own OpenMP team,
        # and once teams outnumber the cores libgomp stops spinning between parallel regions - measured 30% slower
        # decode when the thread that built the model stayed alive (bench/RESULTS.md).
        loaded: concurrent.futures.Future = concurrent.futures.Future()
        self._ready = threading.Event()  # set when the constructor is done (or gave up)
        self._thread = threading.Thread(target=self._loop, args=(loaded,), name="final-engine", daemon=True)
        self._thread.start()
        self.model = loaded.result()
        try:
            self._build(max_running_requests, max_model_len, max_prefill_tokens, mem_fraction_static, random_seed,
                        eos_token_ids)
        finally:
            self._ready.set()

    def _build(self, max_running_requests: int, max_model_len: int | None, max_prefill_tokens: int,
               mem_fraction_static: float, random_seed: int | None, eos_token_ids: Seq[int] | None) -> None:
        model_path = self.model_path
        spec = self.model.spec
        self.spec = spec
        self.max_model_len = min(max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
        self.eos_token_ids = frozenset(eos_token_ids if eos_token_ids is not None else model_eos_token_ids(model_path))
        self.cache = KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, self.dtype, self.device,
                             self.max_model_len)
        self.prefixes = PrefixTable(spec.num_layers, spec.num_kv_heads, spec.head_dim, self.dtype, self.device)
        budget = int(mem_fraction_static * total_memory_bytes(self.device)) - self.model.nbytes
        self.scheduler = Scheduler(self.cache, max_running_requests, max_prefill_tokens, max(budget, 0))
        self.runner = ModelRunner(self.model, self.cache)
        self.stats = EngineStats()
        self._rng = random.Random(random_seed)
        self._tokenizer = None

    # ---- SGLang dialect ------------------------------------------------------------------------------
    async def async_generate(self, prompt: Any = None, sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, image_data: Any = None,
                             return_logprob: bool | list[bool] = False, logprob_start_len: int | list[int] | None = None,
                             top_logprobs_num: int | None = None, rid: str | list[str] | None = None,
                             stream: bool = False, cartridges: Seq[str] | list[Seq[str]] | None = None,
                             **unsupported: Any) -> dict | list[dict] | AsyncIterator[dict]:
        """Generate for one prompt (list[int]) or a batch (list[list[int]]); returns SGLang-shaped dict(s).

        stream=True (one prompt, n=1) returns an async iterator instead, as SGLang does: one dict per new token
        with the cumulative output_ids (SGLang's default without --stream-output), the last with finish_reason."""
        if unsupported:
            raise TypeError(f"async_generate() got unsupported arguments: {sorted(unsupported)}")
        if prompt is not None:
            raise PromptError("the embedded engine is token-in-token-out (skip_tokenizer_init): pass input_ids")
        if top_logprobs_num:
            raise SamplingError("top logprobs are not supported by the embedded engine", "top_logprobs_num")
        if image_data is not None and any(x is not None for x in (image_data if isinstance(image_data, list) else [image_data])):
            raise PromptError("the embedded engine is text-only; image_data must be None")
        single = bool(input_ids) and isinstance(input_ids[0], int)
        batch = [input_ids] if single else input_ids
        if not isinstance(batch, list) or not batch:
            raise PromptError("input_ids must be a non-empty list of token ids or a list of such lists")
        n_items = len(batch)
        per = lambda value, name: _per_item(value, n_items, name)  # noqa: E731
        params = [SamplingParams.from_dict(p) for p in per(sampling_params, "sampling_params")]
        logprob_flags = per(return_logprob, "return_logprob")
        starts = per(logprob_start_len, "logprob_start_len")
        rids = per(rid, "rid")
        carts = _per_cartridge(cartridges, n_items)
        seqs = []
        for i, ids in enumerate(batch):
            for j in range(params[i].n):
                seqs.append(self._make_sequence(i, ids, params[i], j, bool(logprob_flags[i]),
                                                -1 if starts[i] is None else starts[i], rids[i], carts[i]))
        if stream:
            if len(seqs) != 1:
                raise SamplingError("streaming takes one prompt with n=1", "stream")
            return self._stream(seqs[0])
        outs = await asyncio.gather(*(self._submit(seq) for seq in seqs))
        return outs[0] if single and len(outs) == 1 else outs

    def generate(self, input_ids: list[int] | list[list[int]], sampling_params: dict | list[dict] | None = None,
                 **kwargs: Any) -> dict | list[dict]:
        """Blocking form of async_generate (for scripts; from a running event loop use async_generate)."""
        return _run_blocking(self.async_generate(input_ids=input_ids, sampling_params=sampling_params, **kwargs))

    def flush_cache(self) -> bool:
        """SGLang clears its radix cache here. We keep no prompt cache; drop composed cartridge concatenations."""
        self._post(("flush",))
        return True

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self._post(("abort", rid, abort_all))

    def release_memory_occupation(self) -> None:
        """Free the KV pool (veRL's release()); it is rebuilt on the next request."""
        self.call(lambda _runner: self.cache.release())

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._post(("stop",))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)

    # ---- cartridges ----------------------------------------------------------------------------------
    def load_cartridge(self, cartridge_id: str, keys: list[torch.Tensor], values: list[torch.Tensor]) -> PrefixKV:
        """Make a cartridge available to requests: per-layer K/V [1,Hkv,T,D] or [Hkv,T,D], post-RoPE."""
        if not isinstance(cartridge_id, str) or not cartridge_id:
            raise CartridgeError("cartridge id must be a non-empty string", field="id")
        # the device/dtype copy runs on the engine thread (the one thread that does tensor work)
        return self.call(lambda _runner: self.prefixes.add(cartridge_id, keys, values))

    def unload_cartridge(self, cartridge_id: str) -> bool:
        """Remove a cartridge; running requests that use it finish normally (they hold their own reference)."""
        return self.prefixes.remove(cartridge_id)

    def cartridge_ids(self) -> list[str]:
        return self.prefixes.ids()

    # ---- running work on the engine thread -----------------------------------------------------------
    def call(self, fn: Callable[[ModelRunner], Any]) -> Any:
        """Run fn(runner) on the engine thread between steps and return its result (e.g. building a cartridge)."""
        if threading.current_thread() is self._thread:
            return fn(self.runner)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._post(("call", fn, fut))
        return fut.result()

    @property
    def kv_bytes(self) -> int:
        """Bytes held by the row KV pool plus loaded cartridges."""
        return self.cache.nbytes + self.prefixes.nbytes

    # ---- internals -----------------------------------------------------------------------------------
    def _post(self, msg: tuple) -> None:
        if self._closed and msg[0] != "stop":
            raise EngineError("the engine has been shut down")
        self._inbox.put(msg)

    def _make_sequence(self, index: int, ids: Any, params: SamplingParams, sample_index: int, return_logprob: bool,
                       logprob_start_len: int, rid: str | None, cartridges: tuple[str, ...]) -> Sequence:
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise PromptError("input_ids must be a non-empty list of integers", index)
        bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise PromptError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.spec.vocab_size})", index)
        prefix = self.prefixes.get(cartridges)
        context = len(ids) + (prefix.length if prefix else 0)
        if context >= self.max_model_len and prefix is not None and len(ids) < self.max_model_len:
            raise CartridgeError(f"prompt {index}: {context} tokens (cartridge {prefix.length} + prompt {len(ids)}) do "
                                 f"not fit the context window of {self.max_model_len} (max_model_len)",
                                 file=",".join(prefix.ids), field="max_model_len")
        if context >= self.max_model_len:
            raise PromptError(f"{context} tokens (prompt {len(ids)} + cartridge {context - len(ids)}) do not fit the "
                              f"context window of {self.max_model_len} (max_model_len)", index)
        if logprob_start_len >= len(ids):
            raise SamplingError(f"{logprob_start_len} must be below the prompt length {len(ids)}", "logprob_start_len")
        seed = splitmix64(params.seed + sample_index) if params.seed is not None else self._rng.randrange(2**63)
        generator = None if params.greedy else torch.Generator(device="cpu").manual_seed(seed)
        seq = Sequence(
            rid=(rid if params.n == 1 else f"{rid}-{sample_index}") if rid else uuid.uuid4().hex,
            prompt_ids=list(ids), params=params,
            max_new_tokens=min(params.max_new_tokens, self.max_model_len - context - 1),
            stop_ids=frozenset() if params.ignore_eos else self.eos_token_ids | frozenset(params.stop_token_ids),
            prefix=prefix, generator=generator, on_done=lambda s: None, on_error=lambda e: None,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
        )
        if self.scheduler.too_big(seq):
            raise PromptError(f"needs {seq.reserved_tokens} tokens of KV memory, more than the engine's budget", index)
        return seq

    async def _submit(self, seq: Sequence) -> dict:
        if not self._thread.is_alive():
            raise EngineError("the engine thread is not running")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def deliver(set_value) -> None:
            try:
                loop.call_soon_threadsafe(lambda: fut.done() or set_value())
            except RuntimeError:  # the caller's loop is closed: nobody is waiting for this result
                pass

        seq.on_done = lambda s: deliver(partial(fut.set_result, s.to_output()))
        seq.on_error = lambda exc: deliver(partial(fut.set_exception, exc))
        self._post(("add", seq))
        try:
            return await fut
        except asyncio.CancelledError:
            self._post(("abort", seq.rid, False))
            raise

    async def _stream(self, seq: Sequence) -> AsyncIterator[dict]:
        """Yield seq's output after every token; closing the iterator early aborts the request."""
        if not self._thread.is_alive():
            raise EngineError("the engine thread is not running")
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()

        def put(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(chunks.put_nowait, item)
            except RuntimeError:  # the consumer's loop is closed
                pass

        seq.on_token = lambda s: put(s.to_output())  # snapshot taken on the engine thread
        seq.on_done = lambda s: put(s.to_output())
        seq.on_error = put
        self._post(("add", seq))
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
                self._post(("abort", seq.rid, False))

    def _loop(self, loaded: concurrent.futures.Future) -> None:
        try:
            loaded.set_result(CausalLM.from_pretrained(self.model_path, self.dtype, self.device))
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor, which raises it
            loaded.set_exception(exc)
            return
        self._ready.wait()  # the constructor builds the scheduler and cache before the first message
        if not hasattr(self, "runner"):  # the constructor failed after loading: nothing to serve
            return
        with torch.inference_mode():
            while True:
                block = not self.scheduler.has_work()
                try:
                    while True:
                        msg = self._inbox.get(block=block, timeout=None)
                        block = False
                        try:
                            if not self._handle(msg):
                                return
                        except Exception:  # a bad message must not take the engine down
                            logger.exception("engine failed to handle %s", msg[0])
                except queue.Empty:
                    pass
                if self.scheduler.has_work():
                    try:
                        self._step()
                    except Exception as exc:  # keep serving: fail what was in flight, not the engine
                        logger.exception("engine step failed")
                        self._fail_all(EngineError(f"engine step failed: {type(exc).__name__}: {exc}"))

    def _handle(self, msg: tuple) -> bool:
        kind = msg[0]
        if kind == "add":
            self.stats.requests += 1
            self.stats.prompt_tokens += len(msg[1].prompt_ids)
            self.scheduler.add(msg[1])
        elif kind == "abort":
            self._abort(msg[1], msg[2])
        elif kind == "flush":
            self.prefixes.prune_composed({s.prefix for s in self.scheduler.running})
        elif kind == "call":
            fn, fut = msg[1], msg[2]
            try:
                fut.set_result(fn(self.runner))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)
        elif kind == "stop":
            self._fail_all(EngineError("the engine has been shut down"))
            self.cache.release()
            return False
        return True

    def _abort(self, rid: str, abort_all: bool) -> None:
        match = (lambda s: True) if abort_all else (lambda s: s.rid == rid)
        for seq in self.scheduler.drop_waiting(match):
            seq.abort("aborted")
            self.stats.aborted += 1
            seq.on_done(seq)
        gone = [s for s in self.scheduler.running if match(s)]
        for seq in gone:
            seq.abort("aborted")
            self.stats.aborted += 1
        self._finish(gone)

    def _step(self) -> None:
        batch = self.scheduler.next_prefill()
        if batch:
            logits = self.runner.prefill(batch)
            self.stats.prefill_steps += 1
            active = [s for s in batch if s.max_new_tokens > 0]
            for s in batch:
                if s.max_new_tokens <= 0:
                    s.finish_reason = {"type": "length", "length": 0}
            if active:
                rows = [i for i, s in enumerate(batch) if s.max_new_tokens > 0]
                self._append(logits[rows], active)
            self._finish([s for s in batch if s.finish_reason is not None])
            return
        running = list(self.scheduler.running)
        if not running:
            return
        logits = self.runner.decode(running)
        self.stats.decode_steps += 1
        self._append(logits, running)
        self._finish([s for s in running if s.finish_reason is not None])

    def _append(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        tokens, logprobs = sample(logits, seqs)
        stop_texts = self._stop_matcher if any(s.params.stop for s in seqs) else None
        for i, seq in enumerate(seqs):
            seq.append(tokens[i], logprobs[i] if logprobs is not None else None, stop_texts)
        self.stats.generated_tokens += len(seqs)

    def _stop_matcher(self, output_ids: list[int], stops: list[str]) -> str | None:
        """SGLang's stop-string check: decode the tail of the output and look for any stop string."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        window = max(len(s) for s in stops) + 8  # a token is at least one character
        tail = self._tokenizer.decode(output_ids[-window:])
        return next((s for s in stops if s in tail), None)

    def _finish(self, done: list[Sequence]) -> None:
        if not done:
            return
        self.scheduler.remove([s for s in done if s.slot >= 0])
        for seq in done:
            seq.on_done(seq)

    def _fail_all(self, exc: EngineError) -> None:
        for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
            seq.on_error(exc)
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()


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


def _run_blocking(coro):
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise EngineError("generate() was called inside a running event loop; await async_generate() instead")
