"""One row's output -> the OpenAI assistant message: `reasoning_content` (final/tools/reasoning.py), `content` (the
text before the first call) and `tool_calls` (final/tools/stream.py), the same whether the row streams (`feed` each
text delta, then `finish`: OpenAI's delta objects come out) or not (the whole text at once: `message()`).

Calls come out in OpenAI's shape: `{"id": "call_<24 hex>", "type": "function", "function": {"name", "arguments"}}`
with `arguments` a JSON string; a streamed call's first delta carries its index, id, type and name, later ones
pieces of its arguments (`{"index", "function": {"arguments"}}`). With parallel_tool_calls false only the first
call is reported. `finish_reason` becomes "tool_calls" where the row stopped by itself after a call (SGLang's rule).
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any

from final.outputs import GenerationOutput
from final.tools.parser import ToolCallParser
from final.tools.reasoning import ReasoningStream
from final.tools.stream import CallStream, StreamedCall


@dataclass(frozen=True)
class ReplyPlan:
    """How a call's rows are read: its tool-call parser (None: no tools, or tool_choice "none", whose tools are
    rendered but never parsed, as vLLM does), whether reasoning is split, and which prompts open a reasoning block."""

    parser: ToolCallParser | None = None
    reasoning: bool = False
    parallel: bool = True
    forced: tuple[bool, ...] = ()  # per prompt: its generation prompt ends inside <think>
    keep_ids: tuple[int, ...] = field(default=())  # special tokens the text keeps (call / think markers)

    @property
    def active(self) -> bool:
        return self.parser is not None or self.reasoning


class Reply:
    """One row read as it arrives (or all at once)."""

    def __init__(self, plan: ReplyPlan, prompt_index: int = 0):
        self.plan = plan
        forced = plan.forced[prompt_index] if prompt_index < len(plan.forced) else False
        self.thinking = ReasoningStream(forced) if plan.reasoning else None
        self.calls = CallStream(plan.parser) if plan.parser is not None else None
        self.reasoning = ""
        self.content = ""
        self.ids: dict[int, str] = {}

    def feed(self, delta: str) -> list[dict]:
        """OpenAI delta objects for a text delta (empty: nothing decided yet)."""
        return self._read(*(self.thinking.feed(delta) if self.thinking else ("", delta)), final=False)

    def finish(self) -> list[dict]:
        return self._read(*(self.thinking.finish() if self.thinking else ("", "")), final=True)

    def read_all(self, text: str) -> dict:
        """The message of a whole output."""
        self.feed(text)
        self.finish()
        return self.message()

    def _read(self, reasoning: str, content: str, final: bool) -> list[dict]:
        out: list[dict] = []
        if reasoning:
            self.reasoning += reasoning
            out.append({"reasoning_content": reasoning})
        if self.calls is None:
            if content:
                self.content += content
                out.append({"content": content})
            return out
        update = self.calls.feed(content)
        if final:
            tail = self.calls.finish()
            update.text += tail.text
            update.calls += tail.calls
        if update.text:
            self.content += update.text
            out.append({"content": update.text})
        for d in update.calls:
            if self._reported(d.index):
                out.append({"tool_calls": [self._delta(d)]})
        return out

    def _reported(self, index: int) -> bool:
        return self.plan.parallel or index == 0

    def _delta(self, d: Any) -> dict:
        if d.name is None:
            return {"index": d.index, "function": {"arguments": d.arguments}}
        self.ids[d.index] = call_id()
        return {"index": d.index, "id": self.ids[d.index], "type": "function",
                "function": {"name": d.name, "arguments": d.arguments}}

    @property
    def tool_calls(self) -> list[dict]:
        """The reported calls, OpenAI's shape."""
        started = [c for c in self._streamed() if c.started and self._reported(c.index)]
        return [{"id": self.ids[c.index], "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in started]

    @property
    def errors(self) -> list[dict]:
        """Calls the model broke: what the parser says (name when it was read, the raw text)."""
        return [{"name": c.name, "error": c.error, "raw": c.parsed.raw if c.parsed else ""}
                for c in self._streamed() if c.error]

    def _streamed(self) -> list[StreamedCall]:
        return self.calls.calls if self.calls is not None else []

    def message(self) -> dict:
        calls = self.tool_calls
        msg: dict[str, Any] = {"role": "assistant", "content": self.content if self.content or not calls else None}
        if calls:
            msg["tool_calls"] = calls
        if self.plan.reasoning:
            msg["reasoning_content"] = self.reasoning if self.thinking.seen else None
        return msg

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return "tool_calls" if engine_reason == "stop" and self.tool_calls else engine_reason


def read_output(out: GenerationOutput, plan: ReplyPlan | None) -> GenerationOutput:
    """A call's rows read as OpenAI messages: metadata["message"] (content, tool_calls, reasoning_content),
    ["tool_call_errors"] where the model broke a call, finish_reason "tool_calls" where it called and stopped;
    each completion becomes its message's content (the text before the calls, without the reasoning)."""
    if plan is None or not plan.active:
        return out
    completions = []
    for i, (text, meta) in enumerate(zip(out.completions, out.metadata)):
        reply = Reply(plan, i // out.n)
        message = reply.read_all(text)
        meta["message"] = message
        meta["finish_reason"] = reply.finish_reason(meta.get("finish_reason"))
        if reply.errors:
            meta["tool_call_errors"] = reply.errors
        completions.append(message["content"] or "")
    return dataclasses.replace(out, completions=completions)


def call_id() -> str:
    """A tool call's id, unique per call (SGLang's and OpenAI's form)."""
    return f"call_{uuid.uuid4().hex[:24]}"
