"""Samples -> OpenAI response bodies (text_completion, chat.completion, their stream chunks) and /generate's.

Text: the output ids up to the first eos (unless ignore_eos), decoded without special tokens, cut before the
first stop string (Tokasaurus' decode_completion, as vLLM and SGLang do). Logprobs are the chosen tokens'
(OpenAI layouts); `system_fingerprint` carries Tokasaurus' packed completion ids and logprobs
(final/server/fingerprint.py). usage counts each prompt once; a cartridge's tokens count as cached prompt tokens.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Sequence

from final.server.fingerprint import make_fingerprint
from final.server.generation import Sample


class Renderer:
    def __init__(self, tokenizer, eos_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)

    # ---- text ------------------------------------------------------------------------------------------
    def text(self, ids: list[int], stop: list[str], ignore_eos: bool = False) -> str:
        return cut_at_stop(self.raw_text(ids, ignore_eos), stop)

    def raw_text(self, ids: list[int], ignore_eos: bool = False) -> str:
        if not ignore_eos:
            cut = next((i for i, t in enumerate(ids) if t in self.eos), len(ids))
            ids = ids[:cut]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def tokens(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in ids]

    # ---- bodies ----------------------------------------------------------------------------------------
    def completion(self, model: str, samples: list[Sample], job, *, want_logprobs: bool, fingerprint: bool) -> dict:
        choices = []
        for s in samples:
            text = self.text(s.output_ids, job.sampling["stop"], job.sampling.get("ignore_eos", False))
            choices.append({"index": s.index, "text": text, "finish_reason": s.finish_reason,
                            "logprobs": self.completion_logprobs(s.output_ids, s.logprobs) if want_logprobs else None})
        return self._envelope("text_completion", "cmpl", model, choices, samples, job, fingerprint)

    def chat(self, model: str, samples: list[Sample], job, *, want_logprobs: bool, fingerprint: bool) -> dict:
        choices = []
        for s in samples:
            text = self.text(s.output_ids, job.sampling["stop"], job.sampling.get("ignore_eos", False))
            choices.append({"index": s.index, "message": {"role": "assistant", "content": text},
                            "finish_reason": s.finish_reason,
                            "logprobs": self.chat_logprobs(s.output_ids, s.logprobs) if want_logprobs else None})
        return self._envelope("chat.completion", "chatcmpl", model, choices, samples, job, fingerprint)

    def generate(self, model: str | None, sample: Sample, job) -> dict:
        """Seed 001's /generate answer: {text, finish_reason, usage, model}."""
        return {"text": self.text(sample.output_ids, job.sampling["stop"]), "finish_reason": sample.finish_reason,
                "usage": usage([sample], 1), "model": model}

    def _envelope(self, obj: str, prefix: str, model: str, choices: list[dict], samples: list[Sample], job,
                  fingerprint: bool) -> dict:
        by_index = sorted(samples, key=lambda s: s.index)
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()), "model": model,
            "choices": sorted(choices, key=lambda c: c["index"]), "usage": usage(samples, job.n),
            "system_fingerprint": make_fingerprint([s.output_ids for s in by_index],
                                                   [s.logprobs or [] for s in by_index] if fingerprint else None),
        }

    # ---- logprobs ----------------------------------------------------------------------------------------
    def completion_logprobs(self, ids: list[int], logprobs: list[float] | None) -> dict:
        tokens = self.tokens(ids)
        offsets, at = [], 0
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        return {"tokens": tokens, "token_logprobs": list(logprobs or []), "top_logprobs": None, "text_offset": offsets}

    def chat_logprobs(self, ids: list[int], logprobs: list[float] | None) -> dict:
        return {"content": [{"token": tok, "bytes": list(tok.encode("utf-8")), "logprob": lp, "top_logprobs": []}
                            for tok, lp in zip(self.tokens(ids), logprobs or [])]}


def usage(samples: list[Sample], n: int) -> dict[str, Any]:
    """Prompt tokens once per prompt (samples index*n .. index*n+n-1 share it), completion tokens per choice."""
    firsts = [s for s in samples if s.index % n == 0]
    prompt = sum(s.prompt_tokens for s in firsts)
    completion = sum(len(s.output_ids) for s in samples)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if all(s.cached_tokens is not None for s in firsts):
        out["prompt_tokens_details"] = {"cached_tokens": sum(s.cached_tokens for s in firsts)}
    return out


def cut_at_stop(text: str, stop: list[str]) -> str:
    hits = [p for p in (text.find(s) for s in stop) if p != -1]
    return text[:min(hits)] if hits else text


class TextDelta:
    """Incremental text of one streaming choice: each update decodes the cumulative ids and returns what is new.

    Holds back an undecodable tail (a multi-byte character split across tokens) and, while unfinished, the last
    len(longest stop)-1 characters, so text that turns out to start a stop string is never sent."""

    def __init__(self, renderer: Renderer, stop: list[str], ignore_eos: bool):
        self.renderer = renderer
        self.stop = stop
        self.ignore_eos = ignore_eos
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def update(self, ids: list[int], final: bool) -> str:
        raw = self.renderer.raw_text(ids, self.ignore_eos)
        text = cut_at_stop(raw, self.stop)
        stopped = len(text) < len(raw)
        end = len(text)
        if not final and not stopped:
            end = len(text) - self.hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta
