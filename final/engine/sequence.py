"""Sequence: one request's whole state, from admission to its SGLang-shaped output dict."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from final.engine.kv_cache import PrefixKV
from final.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # params.max_new_tokens clipped to the context window
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    cartridges: tuple[str, ...] = ()  # composed in order into `prefix` when the engine admits the request
    prefix: PrefixKV | None = None
    prefix_len: int = 0  # known before admission, so the context check happens where the request is made
    adapter: str | None = None  # the LoRA adapter it runs with (a name), resolved into `lora` at admission
    lora: Any = None  # engine.lora.EngineAdapter: held by the row, so an unload lets it finish with it
    batch: Any = None  # the engine.messages.Batch it reports to, and its row there
    row: int = 0
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0  # with return_logprob: the k most likely tokens at each scored/generated position
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)  # (logprob, token id)
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    status: Status = Status.WAITING
    slot: int = -1
    finish_reason: dict | None = None
    created: float = field(default_factory=time.perf_counter)
    weight_version: int = 0  # the engine's weights when the row was admitted (it finishes on them: messages.Drain)
    on_token: Callable[["Sequence"], None] | None = None  # streaming: called after each token but the last
    grammar: Any = None  # the row's own grammar matcher (final/engine/grammar.RowGrammar) when constrained

    @property
    def cached_len(self) -> int:
        """Own tokens whose K/V are in the row cache (the newest output token is not yet)."""
        return len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)

    @property
    def reserved_tokens(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens

    def append(self, token: int, logprob: float | None,
               stop_texts: Callable[[list[int], list[str]], str | None] | None,
               top: list[tuple[float, int]] | None = None) -> None:
        """Record a sampled token and decide whether the sequence is finished (SGLang's check_finished order).
        A constrained row's grammar follows the token (GrammarError if it does not allow it: the row is aborted)."""
        if self.grammar is not None and token not in self.stop_ids:
            self.grammar.accept(token)
        self.output_ids.append(token)
        if self.return_logprob:
            self.output_logprobs.append(logprob)
            if self.top_logprobs_num:
                self.output_top_logprobs.append(top or [])
        if len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = {"type": "length", "length": self.max_new_tokens}
        elif token in self.stop_ids:
            self.finish_reason = {"type": "stop", "matched": token}
        elif stop_texts is not None and self.params.stop:
            matched = stop_texts(self.output_ids, self.params.stop)
            if matched:
                self.finish_reason = {"type": "stop", "matched": matched}
        if self.on_token is not None and self.finish_reason is None:
            self.on_token(self)

    def abort(self, message: str) -> None:
        self.finish_reason = {"type": "abort", "message": message}

    def to_output(self) -> dict:
        """The dict SGLang 0.5.2's Engine.async_generate returns with skip_tokenizer_init."""
        meta = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.prompt_ids) + self.prefix_len,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.prefix_len,
            "weight_version": self.weight_version,
            "e2e_latency": time.perf_counter() - self.created,
        }
        if self.return_logprob:
            start = self.logprob_start_len if self.logprob_start_len >= 0 else len(self.prompt_ids) - 1
            values = self.input_logprobs if self.input_logprobs is not None else [None]
            meta["input_token_logprobs"] = [(lp, tok, None) for lp, tok in zip(values, self.prompt_ids[start:])]
            meta["output_token_logprobs"] = [(lp, tok, None) for lp, tok in zip(self.output_logprobs, self.output_ids)]
            if self.top_logprobs_num:  # SGLang's layout: [(logprob, token id, None)] per position, None where none
                tops = self.input_top_logprobs if self.input_top_logprobs is not None else [None]
                meta["input_top_logprobs"] = [_triples(t) for t in tops]
                meta["output_top_logprobs"] = [_triples(t) for t in self.output_top_logprobs]
        return {"output_ids": list(self.output_ids), "meta_info": meta}


def _triples(top: list[tuple[float, int]] | None) -> list[tuple[float, int, None]] | None:
    return None if top is None else [(lp, tok, None) for lp, tok in top]
