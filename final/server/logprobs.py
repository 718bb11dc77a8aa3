"""OpenAI's logprobs objects, with token strings made exactly as vLLM makes them (vllm 0.33.0:
vllm/tokenizers/detokenizer_utils.py convert_ids_list_to_tokens, vllm/v1/engine/logprobs.py _verify_tokens and
_correct_decoded_token, vllm/entrypoints/openai/completion/serving.py _create_completion_logprobs).

Why exactly: a completions `top_logprobs` entry is a dict keyed by token string, and evaluation harnesses read it
(lm-eval's loglikelihood compares a token's logprob with the dict's largest value to decide greediness). Two ids
that decode to one string collide in that dict, and which value survives depends on the order the entries are
written in and on how each id is decoded; making both vLLM's makes our answers read the same as a vLLM server's.
- a token is `decode([id])`; for SentencePiece (Metaspace) tokenizers the leading spaces decode() strips are put
  back from the vocabulary piece;
- a token whose text ends in U+FFFD (part of a UTF-8 character split over byte-fallback tokens) is decoded again
  after up to 4 preceding tokens of the sequence, keeping the new text ("" if the character is still incomplete);
  the context is the sequence's earlier tokens that have logprobs (prompt and output are separate sequences);
- a position's completions dict is the chosen token first, then the k most likely (an id seen twice keeps its first
  place), cut to k + 1 entries; logprobs below -9999 are written as -9999.0 (JSON has no -inf);
- the first prompt token has no logprob: `decode(id)`, null logprob, null top_logprobs.
Chat's `top_logprobs` lists the k most likely tokens in rank order (OpenAI's definition; vLLM lists the chosen token
first there too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

REPLACEMENT = "\ufffd"
FLOOR = -9999.0
CONTEXT = 4  # preceding tokens tried when a token's text ends inside a UTF-8 character (vLLM's max_context)


@dataclass
class Entry:
    """One position: the chosen token, its logprob (None: the first prompt token), and the k most likely tokens
    (id, text, logprob), most likely first (None: none were asked for)."""

    token_id: int
    token: str
    logprob: float | None
    top: list[tuple[int, str, float]] | None


class TokenText:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.marker = _space_marker(tokenizer)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """vLLM's convert_ids_list_to_tokens: each id decoded alone, Metaspace leading spaces restored."""
        ids = list(ids)
        if self.marker is None:
            return [self.tokenizer.decode([t]) or "" for t in ids]
        raw = self.tokenizer.convert_ids_to_tokens(ids)
        return [_restore_spaces(r or "", self.tokenizer.decode([t]) or "", self.marker) for t, r in zip(ids, raw)]

    def entries(self, ids: Sequence[int], logprobs: Sequence[float | None], tops: Sequence[Any] | None,
                context: Sequence[int] = ()) -> list[Entry]:
        """Entries of one sequence's positions (tops: per position [(id, logprob)] or None). context: the
        sequence's earlier tokens that have logprobs, when `ids` continue it (a stream's next tokens)."""
        seen = list(context)
        out = []
        for j, (tok, lp) in enumerate(zip(ids, logprobs)):
            if lp is None:  # vLLM: decode(id), no correction, and not part of later tokens' context
                out.append(Entry(tok, self.tokenizer.decode(tok), None, None))
                continue
            top = list(tops[j] or []) if tops is not None else []
            texts = [self._checked(t, s, seen) for t, s in zip([tok] + [t for t, _ in top],
                                                                 self.pieces([tok] + [t for t, _ in top]))]
            out.append(Entry(tok, texts[0], lp, [(t, s, v) for (t, v), s in zip(top, texts[1:])]
                             if tops is not None else None))
            seen.append(tok)
        return out

    def _checked(self, token_id: int, text: str, seen: list[int]) -> str:
        return self._corrected(token_id, seen[-CONTEXT:]) if text.endswith(REPLACEMENT) else text

    def _corrected(self, token_id: int, context: list[int]) -> str:
        """vLLM's _correct_decoded_token: the text this token completes after 1..4 tokens of context."""
        decode = self.tokenizer.decode
        for n in range(1, len(context) + 1):
            ctx = context[-n:]
            full = decode(ctx + [token_id])
            if full.endswith(REPLACEMENT):
                continue
            clean_end = len(ctx)  # context tokens that are themselves parts of the character belong to this one
            for j in range(len(ctx) - 1, -1, -1):
                if not decode([ctx[j]]).endswith(REPLACEMENT):
                    break
                clean_end = j
            prefix = decode(ctx[:clean_end]) if clean_end > 0 else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0
            for a, b in zip(prefix, full):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""


def completion_logprobs(entries: list[Entry], k: int, offset: int = 0) -> dict:
    """/v1/completions' logprobs object (vLLM's _create_completion_logprobs)."""
    tokens, values, tops, offsets = [], [], [], []
    at = offset
    for e in entries:
        tokens.append(e.token)
        offsets.append(at)
        at += len(e.token)
        if e.logprob is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(max(e.logprob, FLOOR))
        first: dict[int, tuple[str, float]] = {e.token_id: (e.token, e.logprob)}
        for tok, text, lp in e.top or []:
            first[tok] = (text, lp)  # an id already present keeps its place (Python dicts do)
        tops.append({text: max(lp, FLOOR) for text, lp in list(first.values())[:k + 1]})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[Entry], k: int) -> dict:
    """/v1/chat/completions' logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    return {"content": [{"token": e.token, "logprob": max(e.logprob, FLOOR), "bytes": _bytes(e.token),
                         "top_logprobs": [{"token": text, "logprob": max(lp, FLOOR), "bytes": _bytes(text)}
                                          for _, text, lp in (e.top or [])[:k]]}
                        for e in entries if e.logprob is not None]}


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def _restore_spaces(raw: str, text: str, marker: str) -> str:
    markers = len(raw) - len(raw.lstrip(marker))
    missing = markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text


def _space_marker(tokenizer: Any) -> str | None:
    """The Metaspace replacement character of a SentencePiece-style fast tokenizer (its decode() strips the
    leading space of a lone piece), else None (ByteLevel tokenizers decode pieces faithfully)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    except (ValueError, TypeError):
        return None
    subs = pre.get("pretokenizers") or [] if pre.get("type") == "Sequence" else [pre]
    return next((sub.get("replacement", "\u2581") for sub in subs if sub.get("type") == "Metaspace"), None)
