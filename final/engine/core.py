"""EngineCore: the engine thread's state and loop. The only code that touches the model's tensors.

The thread blocks on its inbox while idle; with work it drains the inbox between steps, dispatching each typed
message (final/engine/messages.py) by type, then runs one step: a prefill batch of admitted requests, else one
decode step of every running row. Finished rows report to their Batch on this thread.
"""

from __future__ import annotations

import logging
import os
import queue
from dataclasses import dataclass
from typing import Any, Callable

import torch

from final.engine.kv_cache import KVCache, PrefixTable
from final.engine.lora import AdapterTable, lora_sizes
from final.engine.messages import Abort, Call, Drain, Stop, Submit
from final.engine.model import CausalLM
from final.engine.runner import ModelRunner
from final.engine.sampler import sample
from final.engine.scheduler import Scheduler
from final.engine.sequence import Sequence
from final.engine.weights import load_weights
from final.errors import EngineError

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    aborted: int = 0
    faults: int = 0  # rows aborted because serving them failed (of `aborted`)


def total_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class EngineCore:
    def __init__(self, model: CausalLM, model_path: str, *, max_running_requests: int, max_model_len: int,
                 max_prefill_tokens: int, mem_fraction_static: float, eos_token_ids: frozenset[int]):
        spec = model.spec
        self.model, self.spec, self.model_path = model, spec, model_path
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.cache = KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, model.dtype, model.device,
                             max_model_len)
        self.prefixes = PrefixTable(spec.num_layers, spec.num_kv_heads, spec.head_dim, model.dtype, model.device)
        budget = int(mem_fraction_static * total_memory_bytes(model.device)) - model.nbytes
        self.scheduler = Scheduler(self.cache, max_running_requests, max_prefill_tokens, max(budget, 0))
        self.adapters = AdapterTable(lora_sizes(model), spec.num_layers, model.dtype, model.device)
        self.runner = ModelRunner(model, self.cache, self.adapters)
        self.stats = EngineStats()
        self.inbox: queue.Queue = queue.Queue()
        self._tokenizer = None
        self.weight_version = 0  # weight updates applied (load_weights); each row records the one it ran on
        self._drains: list[Drain] = []  # waiting for the rows before them to finish
        self._held: list[Submit] = []  # submitted after a pending drain: admitted once it has run
        self._handlers: dict[type, Callable[[Any], bool]] = {
            Submit: self._submit, Abort: self._abort, Call: self._call, Drain: self._drain, Stop: self._stop}

    # ---- the loop ------------------------------------------------------------------------------------
    def run(self) -> None:
        with torch.inference_mode():
            while True:
                block = not self.scheduler.has_work()
                try:
                    while True:
                        msg = self.inbox.get(block=block)
                        block = False
                        if not self._dispatch(msg):
                            return
                except queue.Empty:
                    pass
                if self.scheduler.has_work():
                    try:
                        self._step()
                    except Exception as exc:  # the bookkeeping after a step broke: nothing is known good
                        logger.exception("engine step failed")
                        self._fail_all(EngineError(f"engine step failed: {type(exc).__name__}: {exc}"))
                if self._drains and not self.scheduler.has_work():
                    self._run_drains()

    def _dispatch(self, msg: Any) -> bool:
        try:
            return self._handlers[type(msg)](msg)
        except Exception:  # a bad message must not take the engine down
            logger.exception("engine failed to handle %s", type(msg).__name__)
            return True

    # ---- handlers ------------------------------------------------------------------------------------
    def _submit(self, msg: Submit) -> bool:
        if self._drains:  # rows after a pending weight update run on the new weights
            self._held.append(msg)
            return True
        failed: set[int] = set()  # batches (requests) refused here: a cartridge unloaded since they were made
        for seq in msg.seqs:
            if id(seq.batch) in failed:
                continue
            try:  # composing several cartridges (a per-layer concatenation) is tensor work: it belongs here
                seq.prefix = self.prefixes.get(seq.cartridges)
                seq.lora = self.adapters.get(seq.adapter) if seq.adapter is not None else None
            except Exception as exc:  # noqa: BLE001 - that request fails with the cause, the others go on
                failed.add(id(seq.batch))
                seq.batch.fail(exc)
        for seq in msg.seqs:
            if id(seq.batch) not in failed:
                seq.weight_version = self.weight_version
                self.stats.requests += 1
                self.stats.prompt_tokens += len(seq.prompt_ids)
                self.scheduler.add(seq)
        return True

    def _abort(self, msg: Abort) -> bool:
        def match(s: Sequence) -> bool:
            return msg.abort_all or s.rid == msg.rid or s.rid in msg.rids

        held = [seq for submit in self._held for seq in submit.seqs if match(seq)]
        for submit in self._held:
            submit.seqs = [seq for seq in submit.seqs if not match(seq)]
        for seq in held + self.scheduler.drop_waiting(match):
            seq.abort(msg.message)
            self.stats.aborted += 1
            seq.batch.row_done(seq.row, seq.to_output())
        gone = [s for s in self.scheduler.running if match(s)]
        for seq in gone:
            seq.abort(msg.message)
            self.stats.aborted += 1
        self._finish(gone)
        return True

    def _call(self, msg: Call) -> bool:
        try:
            msg.future.set_result(msg.fn(self.runner))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            msg.future.set_exception(exc)
        return True

    def _drain(self, msg: Drain) -> bool:
        self._drains.append(msg)
        if not self.scheduler.has_work():
            self._run_drains()
        return True

    def _run_drains(self) -> None:
        """Every pending drain, in order, then the submissions held behind them."""
        drains, self._drains = self._drains, []
        for msg in drains:
            self._call(msg)
        held, self._held = self._held, []
        for submit in held:
            self._submit(submit)

    def update_weights(self, named: list) -> int:
        """Write a checked update (final/engine/weights.py) and count it: rows admitted later record the new
        version. Run as a Drain, so no row is running."""
        load_weights(self.model, named)
        self.weight_version += 1
        return self.weight_version

    def release_memory(self) -> None:
        """The KV pool goes (rebuilt by the next request); on a GPU, back to the device too."""
        self.cache.release()
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def _stop(self, _msg: Stop) -> bool:
        gone = EngineError("the engine has been shut down")
        self._fail_all(gone)
        for seq in (seq for submit in self._held for seq in submit.seqs):
            seq.batch.fail(gone)
        for drain in self._drains:
            drain.future.set_exception(gone)
        self._held, self._drains = [], []
        self.cache.release()
        return False

    # ---- one step ------------------------------------------------------------------------------------
    def _step(self) -> None:
        """A prefill batch of admitted requests, else one decode step of every running row. An exception that no
        single row caused (the forward pass) aborts this step's rows only: rows running while a prefill fails, and
        requests still waiting, go on."""
        batch = self.scheduler.next_prefill()
        seqs = batch or list(self.scheduler.running)
        try:
            self._prefill(batch) if batch else self._decode(seqs)
        except Exception as exc:  # noqa: BLE001 - reported to the step's rows, the engine keeps serving
            logger.exception("engine step failed")
            self._abort_faulty([s for s in seqs if s.finish_reason is None],
                               f"engine step failed: {type(exc).__name__}: {exc}")
        self._finish([s for s in seqs if s.finish_reason is not None])

    def _prefill(self, batch: list[Sequence]) -> None:
        logits = self.runner.prefill(batch)
        self.stats.prefill_steps += 1
        rows = [i for i, s in enumerate(batch) if s.max_new_tokens > 0]
        for s in batch:
            if s.max_new_tokens <= 0:  # scoring only (max_new_tokens=0): the prefill was the work
                s.finish_reason = {"type": "length", "length": 0}
        if rows:
            self._append(logits[rows], [batch[i] for i in rows])

    def _decode(self, running: list[Sequence]) -> None:
        logits = self.runner.decode(running)
        self.stats.decode_steps += 1
        self._append(logits, running)

    def _append(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """One new token per row. A row whose logits are not finite, or whose sampling or bookkeeping raises, is
        aborted alone with the cause; every other row gets exactly the token it would have got without it."""
        logits, seqs = self._drop_nonfinite(logits, seqs)
        picked = self._sample(logits, seqs) if seqs else []
        stop_texts = self._stop_matcher if any(s.params.stop for s, _, _, _ in picked) else None
        for seq, token, logprob, top in picked:
            try:  # the stop-string check decodes, a stream's callback runs: either may raise for this row
                seq.append(token, logprob, stop_texts, top)
            except Exception as exc:  # noqa: BLE001 - this row's fault
                logger.exception("recording a token failed")
                self._abort_faulty([seq], f"recording its token failed: {type(exc).__name__}: {exc}")
        self.stats.generated_tokens += len(picked)

    def _drop_nonfinite(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, list[Sequence]]:
        """Rows whose logits hold NaN or inf (a corrupt weight, an overflow, a NaN cartridge) would sample garbage
        (argmax of NaN) or raise in the draw: abort them here. One sum per row finds them (NaN and inf propagate)."""
        finite = torch.isfinite(logits.sum(dim=-1, dtype=torch.float32))
        if bool(finite.all()):
            return logits, seqs
        ok = finite.tolist()
        self._abort_faulty([s for s, good in zip(seqs, ok) if not good],
                           "the model's logits for this sequence are not finite (NaN or inf)")
        keep = [i for i, good in enumerate(ok) if good]
        return logits[keep], [seqs[i] for i in keep]

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[Sequence, int, float | None, Any]]:
        """sample() over the batch. If it raises, every row is sampled alone from the state it had before (its
        generator restored, its logits unpenalised), so only the rows that fail on their own are lost."""
        states = [s.generator.get_state() if s.generator is not None else None for s in seqs]
        pristine = logits.clone() if any(s.params.has_penalties for s in seqs) else logits  # penalised in place
        try:
            tokens, logprobs, tops = sample(logits, seqs)
            none = [None] * len(seqs)
            return list(zip(seqs, tokens, logprobs if logprobs is not None else none, tops or none))
        except Exception as exc:  # noqa: BLE001 - find the row(s) that cause it
            logger.warning("sampling %d rows failed (%s: %s); sampling them one by one", len(seqs),
                           type(exc).__name__, exc)
        picked = []
        for i, (seq, state) in enumerate(zip(seqs, states)):
            if state is not None:
                seq.generator.set_state(state)
            try:
                tokens, logprobs, tops = sample(pristine[i:i + 1], [seq])
            except Exception as exc:  # noqa: BLE001 - this row's fault
                self._abort_faulty([seq], f"sampling failed: {type(exc).__name__}: {exc}")
                continue
            picked.append((seq, tokens[0], logprobs[0] if logprobs is not None else None, tops and tops[0]))
        return picked

    def _abort_faulty(self, seqs: list[Sequence], cause: str) -> None:
        """Abort rows that failed, each with the cause (finish reason "abort"). Their slots are zeroed: a NaN left
        in a slot's K/V would reach the next row that moves in, since masked keys still multiply values by 0."""
        for seq in seqs:
            seq.abort(cause)
            self.stats.aborted += 1
            self.stats.faults += 1
            if seq.slot >= 0:
                self.cache.clear_slot(seq.slot)

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
        composed = {s.prefix for s in done if s.prefix is not None and len(s.prefix.ids) > 1}
        if composed:  # a composition nobody runs any more is dropped (rebuilt on demand)
            self.prefixes.prune_composed({s.prefix for s in self.scheduler.running}
                                         | {s.prefix for s in self.scheduler.waiting})
        for seq in done:
            seq.batch.row_done(seq.row, seq.to_output())

    def _fail_all(self, exc: EngineError) -> None:
        for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
            seq.batch.fail(exc)
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
