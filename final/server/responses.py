"""Results -> OpenAI response bodies (text_completion, chat.completion, their stream chunks) and /generate's.

Every field comes from the rows InferenceEngine returns (final/outputs.py): the text as generate() gives it
(ids up to the first eos, special tokens skipped, cut before a stop string), the finish reason and token counts
the engine reported. Logprobs are OpenAI's layouts with vLLM's token strings (final/server/logprobs.py): the chosen
tokens', their top-k alternatives, and with `echo` the prompt's tokens first; `system_fingerprint` carries
Tokasaurus' packed completion ids and logprobs (final/protocol/fingerprint.py). usage counts each prompt once;
a cartridge's tokens count as cached prompt tokens.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from final.outputs import Completion, GenerationOutput, cut_at_stop, raw_text
from final.protocol.fingerprint import make_fingerprint
from final.server.logprobs import Entry, TokenText, chat_logprobs, completion_logprobs
from final.server.prepare import Call


class Renderer:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.text = TokenText(tokenizer)

    # ---- bodies ----------------------------------------------------------------------------------------
    def completion(self, call: Call, out: GenerationOutput) -> dict:
        """A text_completion, or with call.chat a chat.completion."""
        rows = out.rows()
        choices = []
        for r, text in zip(rows, out.completions):
            logprobs = None
            if call.logprobs:
                logprobs = (self.chat_logprobs if call.chat else self.completion_logprobs)(call, r)
            if call.echo:  # vLLM: the prompt as sent (token ids decoded), then the completion
                prompt = call.request.prompts[r.index // call.request.n]
                text = (prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.ids)) + text
            content = {"message": {"role": "assistant", "content": text}} if call.chat else {"text": text}
            choices.append({"index": r.index, **content, "finish_reason": r.finish_reason, "logprobs": logprobs})
        if call.chat:
            return self._envelope("chat.completion", "chatcmpl", call, choices, rows)
        return self._envelope("text_completion", "cmpl", call, choices, rows)

    def generate(self, call: Call, out: GenerationOutput) -> dict:
        """Seed 001's /generate answer: {text, finish_reason, usage, model}."""
        rows = out.rows()
        return {"text": out.completions[0], "finish_reason": rows[0].finish_reason, "usage": usage(rows, 1),
                "model": call.model, "weights_version": rows[0].weights_version}

    def _envelope(self, obj: str, prefix: str, call: Call, choices: list[dict], rows: list[Completion]) -> dict:
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()), "model": call.model,
            "choices": choices, "usage": usage(rows, call.request.n),
            "system_fingerprint": make_fingerprint([r.output_ids for r in rows],
                                                   [r.logprobs or [] for r in rows]
                                                   if call.fingerprint_logprobs else None),
            # ours: the weights that made every row of this answer (an asynchronous trainer's staleness)
            "weights_version": rows[0].weights_version if rows else None,
        }

    # ---- logprobs ----------------------------------------------------------------------------------------
    def completion_logprobs(self, call: Call, row: Completion, start: int = 0, offset: int = 0) -> dict:
        """The row's output tokens from `start` (a stream's new ones; `offset`: the text sent before them), after
        the prompt's with echo."""
        entries = self.entries(row, start)
        if call.echo:
            prompt_ids = call.request.ids[row.index // call.request.n]
            entries = self.text.entries(prompt_ids, row.prompt_logprobs or [None] * len(prompt_ids),
                                        row.prompt_top_logprobs if call.top_logprobs else None) + entries
        return completion_logprobs(entries, call.top_logprobs, offset)

    def chat_logprobs(self, call: Call, row: Completion, start: int = 0) -> dict:
        return chat_logprobs(self.entries(row, start), call.top_logprobs)

    def entries(self, row: Completion, start: int = 0) -> list[Entry]:
        """Output positions [start:] of a row (the output's earlier tokens are their context)."""
        ids = row.output_ids
        return self.text.entries(ids[start:], (row.logprobs or [])[start:len(ids)],
                                 row.top_logprobs[start:] if row.top_logprobs is not None else None,
                                 context=ids[max(0, start - 4):start])


def usage(rows: list[Completion], n: int) -> dict[str, Any]:
    """Prompt tokens once per prompt (rows index*n .. index*n+n-1 share it), completion tokens per choice."""
    firsts = [r for r in rows if r.index % n == 0]
    prompt = sum(r.prompt_tokens for r in firsts)
    completion = sum(r.completion_tokens for r in rows)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)}}


class TextDelta:
    """Incremental text of one streaming choice: each update decodes the cumulative ids and returns what is new.

    Holds back an undecodable tail (a multi-byte character split across tokens) and, while unfinished, the last
    len(longest stop)-1 characters, so text that turns out to start a stop string is never sent."""

    def __init__(self, tokenizer: Any, eos_ids: set[int], stop: tuple[str, ...], ignore_eos: bool):
        self.tokenizer, self.eos_ids, self.stop, self.ignore_eos = tokenizer, eos_ids, stop, ignore_eos
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def update(self, ids: list[int], final: bool) -> str:
        raw = raw_text(self.tokenizer, ids, eos_ids=self.eos_ids, ignore_eos=self.ignore_eos)
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
