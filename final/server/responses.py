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
from typing import Any, Iterable

from final.outputs import Completion, GenerationOutput, special_ids
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
            # a call with tools or a thinking model: its rows were read (final/tools/reply.py) into OpenAI messages
            message = out.metadata[r.index].get("message") or {"role": "assistant", "content": text}
            content = {"message": message} if call.chat else {"text": text}
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
    """Incremental text of one streaming choice: each update decodes only the tokens that arrived (with a window of
    a few before them: vLLM's prefix/read offsets, so a token whose text depends on its left neighbour decodes as it
    does in the whole), so a row of N tokens costs O(N), not the O(N^2) of re-decoding it at every update. What it
    sends concatenates to the whole output's text (final.outputs.completion_text).

    Holds back an undecodable tail (a multi-byte character split across tokens) and, while unfinished, the last
    len(longest stop)-1 characters, so text that turns out to start a stop string is never sent."""

    def __init__(self, tokenizer: Any, eos_ids: set[int], stop: tuple[str, ...], ignore_eos: bool,
                 keep_ids: Iterable[int] = ()):
        self.tokenizer, self.eos_ids, self.stop, self.ignore_eos = tokenizer, eos_ids, stop, ignore_eos
        keep = frozenset(keep_ids)
        self.dropped = special_ids(tokenizer) - keep if keep else frozenset()
        self.skip = not keep  # no markers to keep: the tokenizer's own skip_special_tokens
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.longest = max((len(s) for s in stop), default=0)
        self.sent = 0
        self.text = ""  # decoded text that no later token can change
        self.ids: list[int] = []  # the row's ids decoded so far (up to the first eos, markers filtered)
        self.seen = 0  # ids of the row consumed
        self.ended = False  # an eos (or a stop string) ended the text
        self.prefix = self.read = 0  # self.ids[prefix:read] is the decoded window before the new tokens
        self.scanned = 0  # self.text[:scanned] holds no stop string

    def update(self, ids: list[int], final: bool) -> str:
        self._consume(ids)
        self._decode(final)
        self._cut_at_stop()
        end = len(self.text) if final or self.ended else len(self.text) - self.hold
        if end <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:end], end
        return delta

    def _consume(self, ids: list[int]) -> None:
        for t in ids[self.seen:]:
            if self.ended:
                break
            if t in self.eos_ids and not self.ignore_eos:
                self.ended = True
            elif t not in self.dropped:
                self.ids.append(t)
        self.seen = len(ids)

    def _decode(self, final: bool) -> None:
        if self.read == len(self.ids):
            return
        before = self._text(self.ids[self.prefix:self.read])
        now = self._text(self.ids[self.prefix:])
        if final or self.ended or (len(now) > len(before) and not now.endswith("\ufffd")):
            self.text += now[len(before):]
            self.prefix, self.read = self.read, len(self.ids)

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def _cut_at_stop(self) -> None:
        if not self.stop:
            return
        start = max(0, self.scanned - self.longest + 1)
        hits = [p for p in (self.text.find(s, start) for s in self.stop) if p != -1]
        if hits:
            self.text, self.ended = self.text[:min(hits)], True
        self.scanned = len(self.text)
