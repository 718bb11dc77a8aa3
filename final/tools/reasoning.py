"""Thinking models: the `<think>...</think>` reasoning of an output split from its answer, as SGLang's reasoning
parsers (qwen3, deepseek-r1: sglang/srt/parser/reasoning_parser.py) and vLLM's split it into `reasoning_content`.

`ReasoningStream(forced)`: `feed(delta)` / `finish()` return (reasoning, content) pieces. The reasoning is what
stands between `<think>` (where the output opens with it, after whitespace) and `</think>`, stripped; the answer is
what follows, its leading whitespace stripped. `forced`: the prompt already opened the block (DeepSeek-R1's and
Qwen3-thinking's templates end the generation prompt with `<think>\\n`), so the output starts inside it. An output
that never closes the block is all reasoning (cut by max_tokens); one that does not open it is all answer, unchanged.
Like CallStream, what comes out does not depend on how the text was cut into deltas.

`reasoning_parser` (config key): auto (on when `<think>` and `</think>` are tokens of the vocabulary, as Qwen3's and
DeepSeek-R1's are), qwen3 / deepseek_r1 (on: both read the same tags; deepseek_r1 always starts inside the block, as
SGLang's DeepSeekR1Detector), none.
"""

from __future__ import annotations

from typing import Any

from final.chat_template import REASONING_PARSERS, vocabulary
from final.errors import ConfigError
from final.tools.stream import partial_suffix

START, END = "<think>", "</think>"
PARSERS = REASONING_PARSERS


def check_reasoning_parser(value: Any, key: str = "reasoning_parser") -> str:
    if value not in PARSERS:
        raise ConfigError(f"must be one of {', '.join(PARSERS)}, got {value!r}", key=key)
    return value


def reasoning_enabled(setting: str, tokenizer: Any) -> bool:
    """Whether outputs of this model are split (the config's reasoning_parser)."""
    if setting == "auto":
        vocab = vocabulary(tokenizer)
        return START in vocab and END in vocab
    return setting != "none"


def opens_reasoning(prompt_text: str, setting: str) -> bool:
    """Whether the prompt leaves the output inside a reasoning block (its generation prompt ends with <think>)."""
    return setting == "deepseek_r1" or prompt_text.rstrip().endswith(START)


class ReasoningStream:
    def __init__(self, forced: bool = False):
        self.state = "reasoning" if forced else "detect"
        self.seen = forced  # a reasoning block was opened (the answer then has reasoning_content)
        self._buf = ""
        self._began = False  # reasoning text has started (its leading whitespace is dropped)

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        return self._step(final=True)

    def _step(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        while True:
            if self.state == "detect":
                head = self._buf.lstrip()
                if head.startswith(START):
                    self.state, self.seen, self._buf = "reasoning", True, head[len(START):]
                    continue
                if not final and START.startswith(head):  # may still open the block
                    return reasoning, content
                self.state = "content"
                content, self._buf = self._buf, ""
                return reasoning, content
            if self.state == "reasoning":
                piece, closed = self._reasoning(final)
                reasoning += piece
                if closed:
                    continue
                return reasoning, content
            if self.state == "answer":  # the answer after </think>: its leading whitespace dropped
                stripped = self._buf.lstrip()
                if stripped or final:
                    self.state, self._buf = "content", stripped
                    continue
                return reasoning, content
            content, self._buf = content + self._buf, ""
            return reasoning, content

    def _reasoning(self, final: bool) -> tuple[str, bool]:
        """The reasoning text the buffer holds for sure: the block's leading whitespace dropped, trailing whitespace
        held until more text follows (dropped where the block closes or the output ends). (text, block closed)."""
        at = self._buf.find(END)
        end = at if at >= 0 else len(self._buf) - (0 if final else partial_suffix(self._buf, END))
        avail = self._buf[:end]
        lead = 0 if self._began else len(avail) - len(avail.lstrip())
        out = avail[lead:].rstrip()
        self._began = self._began or bool(out)
        if at >= 0:
            self.state, self._buf = "answer", self._buf[at + len(END):]
            return out, True
        self._buf = self._buf[lead + len(out):]
        return out, False
