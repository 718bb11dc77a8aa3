"""Constrained decoding for the embedded engine: SGLang's json_schema / regex / ebnf / structural_tag keys as
llguidance grammars, a matcher per row and the token mask the sampler applies.

- `GrammarCompiler` (one per engine) turns a constraint into an llguidance grammar once: an LRU keyed by
  (key, text) holds a compiled matcher, and each row gets its own copy (`RowGrammar`), so the n copies of a
  prompt advance separately. Compiling runs on the caller's thread, before any row is sent to the engine thread,
  so a bad constraint is a SamplingError naming the key (an HTTP 400) and nothing runs. Compile and per-token
  work are bounded by llguidance's parser limits (`PARSER_LIMITS`: lexer fuel, grammar size, Earley items), so
  a pathological grammar is refused, never left running.
- The llguidance tokenizer is built from the model's HF tokenizer on the first constrained request (about a
  second for SmolLM2's 49k tokens); EOS is the engine's EOS ids.
- `mask_logits` fills each constrained row's bitmask and sets disallowed logits to -inf, in place, before
  temperature and the top-k/top-p/min-p filters (after penalties, as SGLang does), so logprobs are those of the
  masked distribution. A row whose grammar is complete may only choose a stop token: EOS is forced.
Formats: JSON schema (llguidance's, flexible whitespace as SGLang's xgrammar default), regex (Rust regex syntax),
EBNF (xgrammar's / llama.cpp's GBNF dialect, converted by llguidance's gbnf_to_lark), structural tags
(final/engine/structural_tag.py).
"""

from __future__ import annotations

import collections
import json
import threading
from typing import Any, Iterable

import llguidance as llg
import numpy as np
import torch
from llguidance.gbnf_to_lark import any_to_lark

from final.engine.structural_tag import structural_tag_to_lark
from final.errors import SamplingError

# the engine's own bound on a constraint's text, for callers that bypass InferenceEngine's limits.max_grammar_bytes
# (veRL); measured on 2 cores, a 300 KB EBNF of 30k alternatives took 6.6 s to compile, a 490 KB enum 0.8 s
MAX_BYTES = 2**20
CACHE_SIZE = 128  # compiled grammars kept per engine (least recently used leave first)
MESSAGE_LIMIT = 400  # characters of llguidance's error kept in a SamplingError
# Bounds on the work one grammar may take. llguidance counts "fuel" (initial lexer ~50k units/ms, a step's lexer
# ~14k/ms, Earley items ~20k/ms): beyond these a compile or a token's mask fails (the request is refused or the
# row aborted) instead of running on. The defaults are llguidance's, except verbose_errors (errors would carry
# the whole grammar) and a grammar-size bound of 200k symbols (a JSON schema of ~1 MB).
PARSER_LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
                     max_grammar_size=200_000, max_lexer_states=250_000, verbose_errors=False)


class GrammarError(RuntimeError):
    """A row's grammar broke while decoding (a token it does not allow, or its work limit): the row is aborted."""


def llg_tokenizer(model_path: str, vocab_size: int, eos_ids: Iterable[int]) -> llg.LLTokenizer:
    """llguidance's tokenizer for the model's HF fast tokenizer, the mask sized to the model's logits.
    A GGUF-converted byte-level BPE (builtin:smollm2-135m-instruct) carries a decoder Sequence of ByteFallback,
    Replace and ByteLevel, which llguidance reads as byte-fallback pieces ("Ġ" would be three bytes, not a space):
    the ByteLevel decoder alone is what those tokens mean."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    decoder = backend.get("decoder") or {}
    if (backend.get("pre_tokenizer") or {}).get("type") == "ByteLevel" and decoder.get("type") == "Sequence":
        levels = [d for d in decoder.get("decoders", []) if d.get("type") == "ByteLevel"]
        if levels:
            backend["decoder"] = levels[0]
    return llg.LLTokenizer(json.dumps(plain_added_tokens(backend)), n_vocab=vocab_size, eos_token=sorted(eos_ids))


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: the character a byte-level BPE vocabulary writes for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


def plain_added_tokens(backend: dict) -> dict:
    """The tokenizer with its non-special added tokens (Qwen's <tool_call>, </tool_call>, <think>) moved into the
    model's vocabulary. llguidance reads every added token as special (matched only by a grammar's <[id]>), but
    HF encodes these from text and the model writes them as text: in a grammar's "<tool_call>" they are the
    text's bytes, as xgrammar treats them. Only where the vocabulary can spell them (byte-level BPE, or ASCII
    without spaces); any other stays special."""
    model = backend.get("model") or {}
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        return backend
    byte_level = (backend.get("pre_tokenizer") or {}).get("type") == "ByteLevel" or \
        (backend.get("decoder") or {}).get("type") == "ByteLevel"
    alphabet = _byte_level_alphabet() if byte_level else None
    kept = []
    for entry in backend.get("added_tokens") or []:
        text = entry.get("content", "")
        if entry.get("special", True) or not text:
            kept.append(entry)
        elif alphabet is not None:
            vocab.setdefault("".join(alphabet[b] for b in text.encode("utf-8")), entry["id"])
        elif text.isascii() and " " not in text:
            vocab.setdefault(text, entry["id"])
        else:
            kept.append(entry)
    backend["added_tokens"] = kept
    return backend


def grammar_text(key: str, text: str) -> str:
    """The llguidance grammar of one constraint (not yet checked against the tokenizer). SamplingError naming
    the key for text that is not what the key takes."""
    try:
        if key == "json_schema":
            schema = json.loads(text)
            if schema is True:
                schema = {}
            if not isinstance(schema, dict):
                raise SamplingError(f"must be a JSON schema object, got {type(schema).__name__}", key)
            return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        if key == "regex":
            return llg.LLMatcher.grammar_from_regex(text)
        if key == "ebnf":
            return llg.LLMatcher.grammar_from_lark(any_to_lark(text))
        if key == "structural_tag":
            return llg.LLMatcher.grammar_from_lark(structural_tag_to_lark(json.loads(text)))
    except json.JSONDecodeError as exc:
        raise SamplingError(f"is not valid JSON: {exc}", key) from None
    except SamplingError:
        raise
    except Exception as exc:  # noqa: BLE001 - the converters raise plain errors for bad grammar text
        raise SamplingError(f"cannot be compiled: {_cut(exc)}", key) from None
    raise SamplingError(f"unknown constraint key {key!r}", key)


def _cut(error: Any) -> str:
    text = str(error).strip()
    return text if len(text) <= MESSAGE_LIMIT else text[:MESSAGE_LIMIT] + "..."


class GrammarCompiler:
    """Compiles constraints for one engine; thread-safe (requests are validated on their callers' threads)."""

    def __init__(self, model_path: str, vocab_size: int, eos_ids: Iterable[int], cache_size: int = CACHE_SIZE):
        self.model_path, self.vocab_size, self.eos_ids = model_path, vocab_size, frozenset(eos_ids)
        self.cache_size = cache_size
        self.limits = llg.LLParserLimits(**PARSER_LIMITS)
        self._tokenizer: llg.LLTokenizer | None = None
        self._cache: collections.OrderedDict[tuple[str, str], llg.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (cache misses), for tests and benchmarks

    @property
    def tokenizer(self) -> llg.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llg_tokenizer(self.model_path, self.vocab_size, self.eos_ids)
        return self._tokenizer

    def row(self, key: str, text: str) -> "RowGrammar":
        """A fresh matcher for one row (a copy of the cached compiled grammar)."""
        if len(text) > MAX_BYTES:
            raise SamplingError(f"{len(text)} characters exceed the embedded engine's bound of {MAX_BYTES}", key)
        with self._lock:
            template = self._cache.get((key, text))
            if template is None:
                template = self._compile(key, text)
                self._cache[(key, text)] = template
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end((key, text))
            return RowGrammar(template.deep_copy(), key)

    def _compile(self, key: str, text: str) -> llg.LLMatcher:
        grammar = grammar_text(key, text)
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)  # errors: is_error()
        if matcher.is_error():
            raise SamplingError(f"cannot be compiled: {_cut(matcher.get_error())}", key)
        self.compiles += 1
        return matcher


class RowGrammar:
    """One row's matcher: fills the row's mask and follows the tokens it chooses."""

    __slots__ = ("matcher", "key")

    def __init__(self, matcher: llg.LLMatcher, key: str):
        self.matcher, self.key = matcher, key

    def fill(self, bitmask: torch.Tensor, index: int) -> bool:
        """Write the allowed tokens into bitmask[index] (int32 words, bit t%32 of word t//32); returns whether the
        grammar is complete-able here (a stop token may end the row)."""
        row = bitmask[index]
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if self.matcher.is_error():
            raise GrammarError(f"{self.key} constraint failed: {_cut(self.matcher.get_error())}")
        return self.matcher.is_accepting()

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} breaks the {self.key} constraint: "
                               f"{_cut(self.matcher.get_error())}")


def banned_tokens(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [B, vocab]: True where a bitmask (int32 words, bit t%32 of word t//32) does not allow token t."""
    allowed = np.unpackbits(bits.cpu().numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return torch.from_numpy(allowed == 0)


def mask_logits(logits: torch.Tensor, grammars: list[RowGrammar | None], stop_ids: list[frozenset[int]]) -> None:
    """Set logits [B,V] of tokens each constrained row's grammar does not allow to -inf (in place). A row whose
    grammar could end here may also take any of its stop tokens (EOS, stop_token_ids)."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    vocab = logits.shape[1]
    bits = torch.zeros((len(rows), (vocab + 31) // 32), dtype=torch.int32)
    ends = [grammars[i].fill(bits, j) for j, i in enumerate(rows)]
    banned = banned_tokens(bits, vocab)
    for j, (i, end) in enumerate(zip(rows, ends)):
        if end and stop_ids[i]:
            banned[j, [t for t in stop_ids[i] if t < vocab]] = False
    banned = banned.to(logits.device)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(banned, float("-inf"))
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(banned, float("-inf"))
