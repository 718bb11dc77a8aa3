"""Server-sent events for `stream: true`: OpenAI's chunk objects, `data: {...}\\n\\n` each, then `data: [DONE]`.

Chat choices open with a `{"role": "assistant", "content": ""}` delta; every update then carries the new text
(final/server/responses.py TextDelta) and, when asked, the logprobs of the tokens that arrived; a choice closes
with its finish_reason. With stream_options.include_usage a last chunk has empty choices and the usage.
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

logger = logging.getLogger(__name__)


def _event(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def sse(call: Call, updates: AsyncIterator[Completion], renderer: Renderer, eos_ids: set[int],
              redact: Callable[[str], str] | None = None) -> AsyncIterator[str]:
    rid = f"{'chatcmpl' if call.chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    obj = "chat.completion.chunk" if call.chat else "text_completion"
    params = call.request.sampling.params
    deltas: dict[int, TextDelta] = {}
    reported: dict[int, int] = {}  # tokens whose logprobs were sent, per choice
    finals: dict[int, Completion] = {}

    def chunk(choice: dict) -> str:
        return _event({"id": rid, "object": obj, "created": created, "model": call.model, "choices": [choice]})

    try:
        if call.chat:
            for i in range(call.request.rows):
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
        async for s in updates:
            delta = deltas.setdefault(s.index, TextDelta(renderer.tokenizer, eos_ids, call.request.sampling.stop,
                                                         bool(params.get("ignore_eos"))))
            sent_before = delta.sent
            text = delta.update(s.output_ids, final=s.finish_reason is not None)
            start = reported.get(s.index, 0)
            logprobs = None
            if call.logprobs and len(s.output_ids) > start:  # the tokens that arrived (their text offsets continue)
                logprobs = renderer.chat_logprobs(call, s, start) if call.chat else \
                    renderer.completion_logprobs(call, s, start, sent_before)
                reported[s.index] = len(s.output_ids)
            if not text and logprobs is None and s.finish_reason is None:
                continue
            if call.chat:
                yield chunk({"index": s.index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                             "finish_reason": s.finish_reason})
            else:
                yield chunk({"index": s.index, "text": text, "logprobs": logprobs, "finish_reason": s.finish_reason})
            if s.finish_reason is not None:
                finals[s.index] = s
        if call.include_usage:
            yield _event({"id": rid, "object": obj, "created": created, "model": call.model, "choices": [],
                          "usage": usage(list(finals.values()), call.request.n)})
    except FinalError as exc:
        yield _event(from_final(exc, call.prompt_param).body(redact))
    except Exception as exc:  # noqa: BLE001 - the response has started: report in-band, keep serving
        logger.exception("stream failed")
        yield _event(APIError(500, f"internal error: {type(exc).__name__}: {exc}").body(redact))
    finally:
        await updates.aclose()  # aborts the engine rows of a stream cut short, releases its cartridges
    yield "data: [DONE]\n\n"
