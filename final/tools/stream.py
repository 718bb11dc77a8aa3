"""Tool calls read a text delta at a time (final serve's streaming, and, fed the whole text once, every answer
that reports calls in OpenAI's shape: the server's message and GenerationOutput's rows, so both agree exactly).

`CallStream(parser)`: `feed(delta)` and, at the end, `finish()` return an `Update`: the new normal text and the call
deltas (`CallDelta`: a call's first delta carries its index and name, later ones pieces of its arguments). Rules:
- normal text is the text before the first call; whitespace right before a call, and a tail that may be the start
  of a call marker, are held until what follows decides (so a partial `<tool_call>` never goes out as text); text
  after the first call is not content (SGLang's normal_text is the text before the first call too);
- a call starts (index, name) as soon as its name is complete; its arguments then stream as the model writes them
  (the raw JSON text of its arguments object, so the pieces concatenate to valid JSON);
- when a call block closes (or the output ends), the block is parsed whole by the format's non-streaming rules
  (final/tools/parser.py) and that decides: a call whose arguments were not an object as written (double-encoded,
  missing: `{}`) gets them as JSON now, a call the preview could not read (the name after the arguments) is sent
  whole, and a broken call keeps what was sent (its arguments as the model wrote them, which OpenAI's API allows to
  be invalid JSON) with `error` set in `calls` (ParsedCall's message).
What is sent depends only on the text, never on how it was cut into deltas: a whole output fed at once gives the
same calls as the same output streamed token by token.
`calls` lists every call seen, in order: `started` ones were sent (they are the answer's tool calls).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from final.tools.parser import ParsedCall, ToolCallParser, json_end, parse_block, parse_sequence


@dataclass(frozen=True)
class CallDelta:
    index: int
    name: str | None = None  # set on a call's first delta
    arguments: str = ""


@dataclass
class Update:
    text: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass
class StreamedCall:
    """A call as streamed: `arguments` is the text sent so far (all of it once the stream finished)."""

    index: int = -1  # -1: never sent (a call whose name could not be read)
    name: str | None = None
    arguments: str = ""
    error: str | None = None
    parsed: ParsedCall | None = None

    @property
    def started(self) -> bool:
        return self.index >= 0


@dataclass
class _Scan:
    """What the preview reads of one call object: its name, and where its arguments object starts and ends."""

    name: str | None = None
    args: tuple[int, int | None] | None = None  # (start, end or None while open) of an object value


class CallStream:
    def __init__(self, parser: ToolCallParser):
        self.parser = parser
        self.syntax = parser.syntax
        self.calls: list[StreamedCall] = []
        self._pending = ""  # text not yet decided (outside calls)
        self._body: str | None = None  # the open block's text (after its start marker), None outside blocks
        self._block: list[StreamedCall] = []  # the open block's calls, by position in the block
        self._spoke = False  # normal text was sent (a bare llama3 call can only open the output)
        self._called = False  # a call started: later text is not content
        self._next = 0

    # ---- feeding -------------------------------------------------------------------------------------
    def feed(self, delta: str) -> Update:
        out = Update()
        if self._body is not None:
            self._body += delta
        else:
            self._pending += delta
        self._advance(out, final=False)
        return out

    def finish(self) -> Update:
        """The end of the output: held text goes out (if no call came), an open block is parsed as it stands."""
        out = Update()
        self._advance(out, final=True)
        if self._body is not None:
            self._close(self._body, out, closed=False)
            self._body = None
        elif not self._called and self._pending:
            out.text += self._pending
        self._pending = ""
        return out

    def _advance(self, out: Update, final: bool) -> None:
        while True:
            if self._body is None:
                at, skip = self._find_start(self._pending, final)
                if at < 0:
                    self._hold_text(out, final)
                    return
                if not self._called:
                    out.text += self._pending[:at].rstrip()
                self._called = True
                self._body, self._pending, self._block = self._pending[at + skip:], "", []
                continue
            end = self._block_end(self._body)
            if end is None:
                self._preview(self._visible(self._body), out)
                return
            stop, after = end
            self._close(self._body[:stop], out, closed=True)
            self._body, self._pending = None, self._body[after:]

    def _find_start(self, text: str, final: bool) -> tuple[int, int]:
        """(where a call starts in `text`, how long its marker is); (-1, 0) when none starts there yet."""
        at = text.find(self.parser.start)
        if self.syntax.starts_bare and not self._spoke and not self._called and text.lstrip().startswith("{"):
            return len(text) - len(text.lstrip()), 0
        return (at, len(self.parser.start)) if at >= 0 else (-1, 0)

    def _hold_text(self, out: Update, final: bool) -> None:
        """Send the pending text but a tail that may still start a call (and the whitespace before it)."""
        text = self._pending
        keep = 0 if final else partial_suffix(text, self.parser.start)
        if not final and self.syntax.starts_bare and not self._spoke and not self._called and not text.strip():
            keep = len(text)  # only whitespace so far: the output may still open with a bare call
        head = text[:len(text) - keep]
        sent = head.rstrip() if not final else head
        if self._called:  # after the first call nothing is content: keep only what may start the next call
            self._pending = text[len(text) - keep:]
            return
        out.text += sent
        self._spoke = self._spoke or bool(sent.strip())
        self._pending = text[len(sent):]

    # ---- blocks --------------------------------------------------------------------------------------
    def _block_end(self, body: str) -> tuple[int, int] | None:
        """(end of the block's text, where the text after it starts), or None while it is open."""
        if self.syntax.array:
            end = json_end(body, _first_bracket(body))
            return None if end is None else (end, end)
        if not self.syntax.end:
            return None  # llama3: the calls run to the end of the output
        at = body.find("</tool_call>")
        return None if at < 0 else (at, at + len("</tool_call>"))

    def _visible(self, body: str) -> str:
        """The open block's text without a tail that may be the start of its end marker."""
        if self.syntax.end and not self.syntax.array:
            return body[:len(body) - partial_suffix(body, "</tool_call>")]
        return body

    def _preview(self, body: str, out: Update) -> None:
        """Start calls whose names are complete and send the argument text that arrived."""
        for k, start in enumerate(_objects(body)):
            call = self._slot(k)
            if call.parsed is not None:
                continue
            scan = _scan_object(body, start)
            if not call.started and scan.name:
                self._start(call, scan.name, out)
            if call.started and scan.args is not None:
                a0, a1 = scan.args
                self._send(call, body[a0:len(body) if a1 is None else a1], out)

    def _close(self, body: str, out: Update, closed: bool) -> None:
        """A block is complete (or the output ended in it): what the preview reads of it is sent (as a stream would
        have sent it, whatever the deltas), then its non-streaming parse decides every call in it."""
        self._preview(body, out)
        final = self._parse_body(body, closed)
        scans = [_scan_object(body, s) for s in _objects(body)]
        for k, parsed in enumerate(final):
            call = self._slot(k)
            call.parsed, call.error = parsed, parsed.error
            if not parsed.ok:
                continue
            if call.started and call.name != parsed.name:
                call.error = f"could not parse tool call: it names {call.name!r} and then {parsed.name!r}"
                continue
            if not call.started:
                self._start(call, parsed.name, out)
            scan = scans[k] if k < len(scans) and len(final) == len(scans) else None
            self._send(call, _arguments_text(body, scan, parsed), out)
        for call in self._block[len(final):]:  # previewed, but the block's parse does not have them
            call.error = call.error or "could not parse tool call: the block is not a valid call list"
        self._block = []

    def _parse_body(self, body: str, closed: bool) -> list[ParsedCall]:
        if self.syntax.array:
            return parse_block(body, closed, "the closing ]")
        if not self.syntax.end:
            return parse_sequence(body, self.syntax.separator)
        return parse_block(body, closed)

    def _slot(self, k: int) -> StreamedCall:
        while len(self._block) <= k:
            call = StreamedCall()
            self._block.append(call)
            self.calls.append(call)
        return self._block[k]

    def _start(self, call: StreamedCall, name: str, out: Update) -> None:
        call.index, call.name = self._next, name
        self._next += 1
        out.calls.append(CallDelta(call.index, name=name))

    def _send(self, call: StreamedCall, arguments: str, out: Update) -> None:
        """Send what `arguments` (the call's argument text so far) adds to what was sent."""
        if not arguments.startswith(call.arguments):
            call.error = call.error or "the arguments changed after they were sent"
            return
        piece = arguments[len(call.arguments):]
        if piece:
            call.arguments = arguments
            out.calls.append(CallDelta(call.index, arguments=piece))


def _arguments_text(body: str, scan: _Scan | None, parsed: ParsedCall) -> str:
    """A complete call's argument text: the object as the model wrote it, or (double-encoded, missing, given as
    `parameters` beside `arguments`) the parsed object as JSON."""
    if scan is not None and scan.args is not None and scan.args[1] is not None:
        raw = body[scan.args[0]:scan.args[1]]
        try:
            if json.loads(raw) == parsed.arguments:
                return raw
        except ValueError:
            pass
    return json.dumps(parsed.arguments, ensure_ascii=False)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _first_bracket(body: str) -> int:
    i = len(body) - len(body.lstrip())
    return i if i < len(body) and body[i] == "[" else -1


def _skip(text: str, i: int, chars: str = "") -> int:
    while i < len(text) and (text[i].isspace() or text[i] in chars):
        i += 1
    return i


def _objects(body: str):
    """Start positions of the call objects in a block's text: one object, objects separated by , or ;, or a JSON
    array of them. The last may be incomplete."""
    i = _skip(body, 0)
    if i < len(body) and body[i] == "[":
        i += 1
    while True:
        i = _skip(body, i, ",;")
        if i >= len(body) or body[i] != "{":
            return
        yield i
        end = json_end(body, i)
        if end is None:
            return
        i = end


_DECODER = json.JSONDecoder()


def _scan_object(body: str, start: int) -> _Scan:
    """Read a call object's members as far as they are complete: its name, and where its arguments object
    ("arguments", or llama3's "parameters") starts and, once closed, ends."""
    scan, i = _Scan(), start + 1
    while True:
        i = _skip(body, i, ",")
        if i >= len(body) or body[i] != '"':
            return scan
        try:
            key, i = _DECODER.raw_decode(body, i)
        except ValueError:
            return scan
        i = _skip(body, i)
        if i >= len(body) or body[i] != ":":
            return scan
        i = _skip(body, i + 1)
        if i >= len(body):
            return scan
        if key in ("arguments", "parameters") and body[i] == "{" and scan.args is None:
            end = json_end(body, i)
            scan.args = (i, end)
            if end is None:
                return scan
            i = end
            continue
        try:
            value, i = _DECODER.raw_decode(body, i)
        except ValueError:
            return scan
        if key == "name" and isinstance(value, str) and value and scan.name is None:
            scan.name = value
