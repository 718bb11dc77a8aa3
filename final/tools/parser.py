"""Tool-call parsing for the hermes / qwen25 wire format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

veRL 0.6.0's SGLangRollout parses with SGLang 0.5.2's `FunctionCallParser` (sglang/srt/function_call/qwen25_detector.py
+ base_format_detector.parse_base_json). On output SGLang parses we give the same result: the text before the first
call, stripped, and each call's name and arguments (SGLang re-serialises them with json.dumps; veRL json.loads them
back, a round trip that returns the same dict). Where SGLang silently drops a call (malformed JSON, a missing name, a
non-object entry, a trailing block the model never closed) we return the call with an `error`, so the rollout can
tell the model what went wrong instead of ending the conversation or crashing (veRL catches only JSONDecodeError and
AttributeError around the parser).

Formats:
  qwen25  SGLang's Qwen25Detector: a call starts at "<tool_call>\\n" (its bot_token, newline included).
  hermes  the same tags with any whitespace around the JSON ("<tool_call>{...}</tool_call>" also counts).
  auto    qwen25 when the tokenizer has <tool_call> and </tool_call> tokens (SGLang's detection), else hermes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from final.errors import ToolConfigError

FORMATS = ("hermes", "qwen25", "auto")
START = "<tool_call>"
END = "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    """One call as the model wrote it. `error` is None when name and arguments are usable."""

    name: str | None
    arguments: dict[str, Any] | None
    error: str | None = None
    raw: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class ParseResult:
    normal_text: str
    calls: list[ParsedCall] = field(default_factory=list)


class ToolCallParser:
    """Finds tool calls in a decoded assistant turn."""

    def __init__(self, fmt: str = "hermes"):
        if fmt not in ("hermes", "qwen25"):
            raise ToolConfigError(f"unknown tool-call format {fmt!r}; choose one of {', '.join(FORMATS)}",
                                  key="rollout.multi_turn.format")
        self.format = fmt
        self.start = START + "\n" if fmt == "qwen25" else START

    @classmethod
    def for_tokenizer(cls, fmt: str | None, tokenizer: Any) -> "ToolCallParser":
        """The parser `multi_turn.format` names; "auto" (or None) detects it from the vocabulary as SGLang does."""
        if fmt in (None, "auto"):
            vocab = _vocab(tokenizer)
            return cls("qwen25" if START in vocab and END in vocab else "hermes")
        return cls(fmt)

    def has_tool_call(self, text: str) -> bool:
        return self.start in text

    def parse(self, text: str) -> ParseResult:
        first = text.find(self.start)
        if first < 0:
            return ParseResult(normal_text=text)
        calls: list[ParsedCall] = []
        pos = first
        while pos >= 0:
            body_at = pos + len(self.start)
            end = text.find(END, body_at)
            if end < 0:  # the output stopped inside a call: accept it only if the JSON is complete
                calls.extend(_parse_block(text[body_at:], closed=False))
                break
            calls.extend(_parse_block(text[body_at:end], closed=True))
            pos = text.find(self.start, end + len(END))
        return ParseResult(normal_text=text[:first].strip(), calls=calls)


def _vocab(tokenizer: Any) -> dict:
    try:
        return tokenizer.get_vocab()
    except AttributeError:  # a processor wraps its tokenizer
        return tokenizer.tokenizer.get_vocab()


def _parse_block(body: str, closed: bool) -> list[ParsedCall]:
    raw = body.strip()
    try:
        payload = json.loads(raw, parse_constant=_not_json, parse_float=_finite)
    except json.JSONDecodeError as exc:
        why = "the output ended before </tool_call>" if not closed else f"invalid JSON ({exc.msg} at char {exc.pos})"
        return [ParsedCall(None, None, f"could not parse tool call: {why}", raw)]
    except (ValueError, RecursionError) as exc:  # NaN, 1e999, an int past 4300 digits, nesting past the stack
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        return [ParsedCall(None, None, f"could not parse tool call: invalid JSON ({why})", raw)]
    items = payload if isinstance(payload, list) else [payload]
    if not items:
        return [ParsedCall(None, None, "could not parse tool call: empty list", raw)]
    return [_to_call(item, raw) for item in items]


def _not_json(word: str) -> float:
    raise ValueError(f"{word} is not a JSON number")  # Python's json would accept NaN/Infinity: a tool must not


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def _to_call(item: Any, raw: str) -> ParsedCall:
    if not isinstance(item, dict):
        return ParsedCall(None, None, f"a tool call must be a JSON object with 'name' and 'arguments', "
                                      f"got {type(item).__name__}", raw)
    name = item.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall(None, None, "a tool call needs a non-empty string 'name'", raw)
    # SGLang's parse_base_json: `act.get("parameters") or act.get("arguments", {})`
    args = item.get("parameters") or item.get("arguments", {})
    if args is None:
        args = {}
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return ParsedCall(name, None, f"the arguments of '{name}' must be a JSON object, got {type(args).__name__}",
                          raw)
    return ParsedCall(name, args, None, raw)
