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
from typing import Any, AsyncIterator, Awaitable, Callable

from final.errors import FinalError
from final.server.errors import APIError, from_final
from final.server.generation import Job, Sample
from final.server.responses import Renderer, TextDelta, usage

logger = logging.getLogger(__name__)


def _event(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def sse(chat: bool, model: str, job: Job, updates: AsyncIterator[Sample], renderer: Renderer, *,
              want_logprobs: bool, include_usage: bool, prompt_param: str,
              on_close: Callable[[], Awaitable[Any]]) -> AsyncIterator[str]:
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    stop, ignore_eos = job.sampling["stop"], job.sampling.get("ignore_eos", False)
    deltas: dict[int, TextDelta] = {}
    reported: dict[int, int] = {}  # tokens whose logprobs were sent, per choice
    finals: dict[int, Sample] = {}

    def chunk(choice: dict) -> str:
        return _event({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]})

    try:
        if chat:
            for i in range(len(job.prompts) * job.n):
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
        async for s in updates:
            delta = deltas.setdefault(s.index, TextDelta(renderer, stop, ignore_eos))
            text = delta.update(s.output_ids, final=s.finish_reason is not None)
            start = reported.get(s.index, 0)
            logprobs = None
            if want_logprobs and len(s.output_ids) > start:
                new_ids, new_lps = s.output_ids[start:], (s.logprobs or [])[start:]
                logprobs = renderer.chat_logprobs(new_ids, new_lps) if chat else \
                    renderer.completion_logprobs(new_ids, new_lps)
                reported[s.index] = len(s.output_ids)
            if not text and logprobs is None and s.finish_reason is None:
                continue
            if chat:
                yield chunk({"index": s.index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                             "finish_reason": s.finish_reason})
            else:
                yield chunk({"index": s.index, "text": text, "logprobs": logprobs, "finish_reason": s.finish_reason})
            if s.finish_reason is not None:
                finals[s.index] = s
        if include_usage:
            yield _event({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                          "usage": usage(list(finals.values()), job.n)})
    except FinalError as exc:
        yield _event(from_final(exc, prompt_param).body())
    except Exception as exc:  # noqa: BLE001 - the response has started: report in-band, keep serving
        logger.exception("stream failed")
        yield _event(APIError(500, f"internal error: {type(exc).__name__}: {exc}").body())
    finally:
        try:
            aclose = getattr(updates, "aclose", None)
            if aclose is not None:  # aborts the engine requests of a stream cut short
                await aclose()
        finally:
            await on_close()
    yield "data: [DONE]\n\n"
