"""Tool-call parsing: the one registry of call formats, shared by the multi-turn rollout and `final serve`.

Formats (SGLang's parser names; their wire syntax is final.chat_template.SYNTAX, which the prompt fallback and the
constraints write too):
  qwen25   SGLang's Qwen25Detector (Qwen2.5, Qwen3): a call starts at "<tool_call>\\n" (its bot_token, newline
           included) and ends at "</tool_call>".
  hermes   the same tags with any whitespace around the JSON ("<tool_call>{...}</tool_call>" also counts).
  llama3   SGLang's Llama32Detector: `{"name": ..., "parameters": {...}}` after <|python_tag|>, or as the whole
           output; several calls separated by ";".
  mistral  SGLang's MistralDetector: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`.
  auto     chosen from the tokenizer (final.chat_template.detect_family: qwen25 when <tool_call> and </tool_call>
           are tokens, SGLang's detection; llama3 with <|python_tag|>, mistral with [TOOL_CALLS]; else hermes).

`ToolCallParser.parse` (whole text) is what veRL 0.6.0's SGLangRollout gets from SGLang 0.5.2's FunctionCallParser
where SGLang succeeds: the text before the first call, stripped, and each call's name and arguments (SGLang
re-serialises them with json.dumps; veRL json.loads them back, a round trip that returns the same dict). Where SGLang
silently drops a call (malformed JSON, a missing name, a non-object entry, a trailing block the model never closed)
we return the call with an `error`, so the rollout can tell the model what went wrong instead of ending the
conversation or crashing (veRL catches only JSONDecodeError and AttributeError around the parser). The streaming
form (final/tools/stream.py) reads the same formats a delta at a time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from final.chat_template import FAMILIES, SYNTAX, TOOL_CALL_PARSERS, CallSyntax, detect_family
from final.errors import ToolConfigError

FORMATS = TOOL_CALL_PARSERS
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


def check_format(fmt: Any, key: str = "rollout.multi_turn.format") -> str:
    if fmt not in FORMATS:
        raise ToolConfigError(f"unknown tool-call format {fmt!r}; choose one of {', '.join(FORMATS)}", key=key)
    return fmt


class ToolCallParser:
    """Finds tool calls in a decoded assistant turn."""

    def __init__(self, fmt: str = "hermes"):
        if fmt not in FAMILIES:
            check_format(fmt)
            raise ToolConfigError("'auto' is resolved from a tokenizer: use ToolCallParser.for_tokenizer",
                                  key="rollout.multi_turn.format")
        self.format = fmt
        self.syntax: CallSyntax = SYNTAX[fmt]
        self.start = START + "\n" if fmt == "qwen25" else START if fmt == "hermes" else self.syntax.start

    @classmethod
    def for_tokenizer(cls, fmt: str | None, tokenizer: Any) -> "ToolCallParser":
        """The parser `fmt` names; "auto" (or None) detects it from the vocabulary as SGLang does."""
        return cls(detect_family(tokenizer) if fmt in (None, "auto") else check_format(fmt))

    def first_start(self, text: str) -> int:
        """Where the first call starts in `text` (-1: none)."""
        at = text.find(self.start)
        if self.syntax.starts_bare and text.lstrip().startswith("{"):
            return len(text) - len(text.lstrip())
        return at

    def has_tool_call(self, text: str) -> bool:
        return self.first_start(text) >= 0

    def parse(self, text: str) -> ParseResult:
        first = self.first_start(text)
        if first < 0:
            return ParseResult(normal_text=text)
        if self.syntax.array:
            calls = self._parse_arrays(text, first)
        elif self.syntax.end:
            calls = self._parse_tagged(text, first)
        else:
            calls = parse_sequence(text[first:].removeprefix(self.start), self.syntax.separator)
        return ParseResult(normal_text=text[:first].strip(), calls=calls)

    def _parse_tagged(self, text: str, pos: int) -> list[ParsedCall]:
        """hermes / qwen25: each call between its start and </tool_call>."""
        calls: list[ParsedCall] = []
        while pos >= 0:
            body_at = pos + len(self.start)
            end = text.find(END, body_at)
            if end < 0:  # the output stopped inside a call: accept it only if the JSON is complete
                calls.extend(parse_block(text[body_at:], closed=False))
                break
            calls.extend(parse_block(text[body_at:end], closed=True))
            pos = text.find(self.start, end + len(END))
        return calls

    def _parse_arrays(self, text: str, pos: int) -> list[ParsedCall]:
        """mistral: each [TOOL_CALLS] marker followed by one JSON array of calls."""
        calls: list[ParsedCall] = []
        while pos >= 0:
            body = text[pos + len(self.start):]
            end = json_end(body, body.find("["))
            calls.extend(parse_block(body if end is None else body[:end], end is not None, "the closing ]"))
            if end is None:
                break
            pos = text.find(self.start, pos + len(self.start) + end)
        return calls


def parse_sequence(body: str, separator: str) -> list[ParsedCall]:
    """llama3: JSON objects one after the other, separated by `separator` (and whitespace)."""
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        while pos < len(body) and (body[pos].isspace() or body[pos] == separator):
            pos += 1
        if pos >= len(body):
            return calls
        end = json_end(body, pos)
        if end is None:
            calls.extend(parse_block(body[pos:], False, "the call's closing }"))
            return calls
        calls.extend(parse_block(body[pos:end], True))
        pos = end


def json_end(text: str, start: int) -> int | None:
    """The index after the JSON object or array opening at `start` (brackets matched outside strings); None when
    it never closes in `text` (or `start` opens no object or array)."""
    if start < 0 or start >= len(text) or text[start] not in "{[":
        return None
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def parse_block(body: str, closed: bool, closer: str = END) -> list[ParsedCall]:
    """One call block's text: a call object, or a JSON list of them. closed=False: the output ended inside it
    (before `closer`), which is fine only if its JSON is complete."""
    raw = body.strip()
    try:
        payload = loads_strict(raw)
    except json.JSONDecodeError as exc:
        why = f"the output ended before {closer}" if not closed else f"invalid JSON ({exc.msg} at char {exc.pos})"
        return [ParsedCall(None, None, f"could not parse tool call: {why}", raw)]
    except (ValueError, RecursionError) as exc:  # NaN, 1e999, an int past 4300 digits, nesting past the stack
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        return [ParsedCall(None, None, f"could not parse tool call: invalid JSON ({why})", raw)]
    items = payload if isinstance(payload, list) else [payload]
    if not items:
        return [ParsedCall(None, None, "could not parse tool call: empty list", raw)]
    return [to_call(item, raw) for item in items]


def loads_strict(text: str) -> Any:
    """json.loads refusing what a tool must not get: NaN/Infinity and non-finite numbers (ValueError)."""
    return json.loads(text, parse_constant=_not_json, parse_float=_finite)


def _not_json(word: str) -> float:
    raise ValueError(f"{word} is not a JSON number")  # Python's json would accept NaN/Infinity: a tool must not


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def to_call(item: Any, raw: str) -> ParsedCall:
    """A decoded call object -> ParsedCall (SGLang's parse_base_json rules, errors kept)."""
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
            args = loads_strict(args)
        except ValueError:
            pass
    if not isinstance(args, dict):
        return ParsedCall(name, None, f"the arguments of '{name}' must be a JSON object, got {type(args).__name__}",
                          raw)
    return ParsedCall(name, args, None, raw)
