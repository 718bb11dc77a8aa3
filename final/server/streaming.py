"""Server-sent events for `stream: true`: OpenAI's chunk objects, `data: {...}\\n\\n` each, then `data: [DONE]`.

Chat choices open with a `{"role": "assistant", "content": ""}` delta; every update then carries the new text
(final/server/responses.py TextDelta) and, when asked, the logprobs of the tokens that arrived; a choice closes
with its finish_reason. A call with tools or a thinking model streams OpenAI's message deltas instead
(final/tools/reply.py): `reasoning_content` pieces, `content` (the text before the first call; a partial call
marker is never sent as text), and per call `tool_calls: [{"index", "id", "type", "function": {"name"}}]` first,
then its `arguments` in pieces; the last chunk's finish_reason is "tool_calls" where the row called and stopped. With stream_options.include_usage a last chunk has empty choices and the usage.
An error after the response has started is sent as one `data: {"error": ...}` event before [DONE].
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable

from final.errors import FinalError
from final.outputs import Completion
from final.server.errors import APIError, from_final
from final.server.prepare import Call
from final.server.responses import Renderer, TextDelta, usage
from final.tools.reply import Reply

logger = logging.getLogger(__name__)


def _event(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def sse(call: Call, updates: AsyncIterator[Completion], renderer: Renderer, eos_ids: set[int],
              redact: Callable[[str], str] | None = None) -> AsyncIterator[str]:
    rid = f"{'chatcmpl' if call.chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    obj = "chat.completion.chunk" if call.chat else "text_completion"
    choices = Choices(call, renderer, eos_ids)

    def chunk(choice: dict) -> str:
        return _event({"id": rid, "object": obj, "created": created, "model": call.model, "choices": [choice]})

    try:
        if call.chat:
            for i in range(call.request.rows):
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
        async for s in updates:
            for choice in choices.update(s):
                yield chunk(choice)
        if call.include_usage:
            yield _event({"id": rid, "object": obj, "created": created, "model": call.model, "choices": [],
                          "usage": usage(list(choices.finals.values()), call.request.n)})
    except FinalError as exc:
        yield _event(from_final(exc, call.prompt_param).body(redact))
    except Exception as exc:  # noqa: BLE001 - the response has started: report in-band, keep serving
        logger.exception("stream failed")
        yield _event(APIError(500, f"internal error: {type(exc).__name__}: {exc}").body(redact))
    finally:
        await updates.aclose()  # aborts the engine rows of a stream cut short, releases its cartridges
    yield "data: [DONE]\n\n"


class Choices:
    """Each streaming choice's state: its text (TextDelta), the tokens whose logprobs were sent, and for a call
    whose rows are read (tools, reasoning) its Reply, which turns text deltas into OpenAI's message deltas."""

    def __init__(self, call: Call, renderer: Renderer, eos_ids: set[int]):
        self.call, self.renderer, self.eos_ids = call, renderer, eos_ids
        self.texts: dict[int, TextDelta] = {}
        self.replies: dict[int, Reply] = {}
        self.reported: dict[int, int] = {}  # tokens whose logprobs were sent, per choice
        self.finals: dict[int, Completion] = {}

    def update(self, s: Completion) -> list[dict]:
        """The choice objects (0 or more chunks) an update of row s.index makes."""
        call, done = self.call, s.finish_reason is not None
        params = call.request.sampling.params
        chat = call.request.chat
        delta = self.texts.setdefault(s.index, TextDelta(
            self.renderer.tokenizer, self.eos_ids, call.request.sampling.stop, bool(params.get("ignore_eos")),
            chat.keep_ids if chat is not None else ()))
        sent_before = delta.sent
        text = delta.update(s.output_ids, final=done)
        logprobs = self._logprobs(s, sent_before)
        if done:
            self.finals[s.index] = s
        reply = self._reply(s.index)
        if reply is None or not call.chat:
            if not text and logprobs is None and not done:
                return []
            if call.chat:
                return [{"index": s.index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                         "finish_reason": s.finish_reason}]
            return [{"index": s.index, "text": text, "logprobs": logprobs, "finish_reason": s.finish_reason}]
        deltas = reply.feed(text) + (reply.finish() if done else [])
        out = [{"index": s.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        if logprobs is not None:  # the logprobs of the tokens that arrived ride on this update's last chunk
            out = out or [{"index": s.index, "delta": {}, "logprobs": None, "finish_reason": None}]
            out[-1]["logprobs"] = logprobs
        if done:
            out.append({"index": s.index, "delta": {}, "logprobs": None,
                        "finish_reason": reply.finish_reason(s.finish_reason)})
        return out

    def _reply(self, index: int) -> Reply | None:
        plan = self.call.request.reply
        if plan is None or not plan.active:
            return None
        return self.replies.setdefault(index, Reply(plan, index // self.call.request.n))

    def _logprobs(self, s: Completion, sent_before: int) -> dict | None:
        start = self.reported.get(s.index, 0)
        if not self.call.logprobs or len(s.output_ids) <= start:
            return None
        self.reported[s.index] = len(s.output_ids)  # the tokens that arrived (their text offsets continue)
        return self.renderer.chat_logprobs(self.call, s, start) if self.call.chat else \
            self.renderer.completion_logprobs(self.call, s, start, sent_before)
