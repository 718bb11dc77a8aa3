"""The teacher every cartridge is trained toward and judged against: the model with the document as its system
turn (teacher_system; a cartridge stands for exactly that turn), served as a cartridge where the engine runs here
(ChunkContext), or with a window of the document around a row's sentence for documents longer than the model reads
well (teacher_window)."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from final.cartridges.build import build_from_text
from final.prompts import continuation_ids, document_ids, is_ids


def teacher_system(document: str) -> str:
    """The teacher every cartridge is trained toward and judged against: how a user asks about a document, the
    document itself as the system turn (no template). The one definition learn's rows, the on-policy loop (its
    targets, its validation set, the `match` start) and `eval` share; a cartridge stands for exactly this turn, so
    what follows it is the user's conversation as it would follow the document."""
    return document


def teacher_ids(tokenizer: Any, document: str) -> list[int]:
    """The teacher's system turn as token ids (a cartridge of the whole document is these ids' KV)."""
    return document_ids(tokenizer, teacher_system(document))


class ChunkContext:
    """The teacher's context: a text in a system turn, served as a cartridge where the engine runs here (prefilled
    once, shared by every row), else sent as text. generate() samples in it; teacher_tops() scores given tokens."""

    def __init__(self, inference: Any, system: str, cartridge_id: str):
        self.inference, self.system, self.cid = inference, system, cartridge_id
        self.loaded = False
        self.head: list[int] = []
        self.doc_ids: list[int] = []  # the system turn's ids (set on entry)

    def __enter__(self) -> "ChunkContext":
        engine = self.inference.engine
        ids = self.doc_ids = document_ids(self.inference.tokenizer, self.system)
        if engine is not None and self.inference.cartridges is not None:
            self.inference.cartridges.add(self.cid, build_from_text(engine, ids), pin=True)
            self.loaded = True
        else:
            self.head = ids
        return self

    def generate(self, prompts: list, **sampling: Any) -> Any:
        """prompts: conversations (message lists, rendered after the system turn) or continuation ids."""
        if self.loaded:
            return self.inference.generate(prompts, cartridge=self.cid, **sampling)
        tok = self.inference.tokenizer
        ids = [self.head + (p if is_ids(p) else continuation_ids(tok, p)) for p in prompts]
        return self.inference.generate(ids, **sampling)

    def teacher_scores(self, prompts: list[list[int]], answers: list[list[int]],
                       k: int) -> list[tuple[list[Any], list[float]]]:
        """Per row, for the tokens 1.. of prompt + answer: the teacher's top-k at the position predicting each,
        and its logprob of the token itself (one prefill per row, nothing generated). The answer is scored as
        part of the prompt, so it is bounded by the prompt budget, not by rollout.response_length."""
        rows = [p + a for p, a in zip(prompts, answers)]
        if self.loaded:
            scores = self.inference.score(rows, [None] * len(rows), top_logprobs=k, cartridge=self.cid)
            skip = 1
        else:
            scores = self.inference.score([self.head + r for r in rows], [None] * len(rows), top_logprobs=k)
            skip = len(self.head) + 1
        return [(s.prompt_top_logprobs[skip:], s.prompt_logprobs[skip:]) for s in scores]

    def __exit__(self, *exc: Any) -> None:
        if self.loaded:
            self.inference.cartridges.unpin(self.cid)
            self.inference.unload_cartridge(self.cid)


def token_offsets(tokenizer: Any, text: str) -> list[tuple[int, int]]:
    """Each document token's character span: computed once per document, read by every window and span below."""
    return [tuple(o) for o in tokenizer(text, add_special_tokens=False, return_offsets_mapping=True).offset_mapping]


def teacher_window(tokenizer: Any, text: str, span: tuple[int, int], tokens: int,
                   offsets: list[tuple[int, int]] | None = None) -> str:
    """The `tokens`-token window of `text` centred on the character span `span`: shifted, not shrunk, at the
    document's ends, and always the whole span (eval's relevant-chunk row asks each question after the same).
    `offsets`: token_offsets(tokenizer, text), for callers asking many windows of one document."""
    offsets = offsets if offsets is not None else token_offsets(tokenizer, text)
    first, last = token_range(offsets, span)
    lo = min(first, max(0, min(first - (tokens - (last - first)) // 2, len(offsets) - tokens)))
    hi = max(last, min(len(offsets), lo + tokens))
    return text[offsets[lo][0]:offsets[hi - 1][1]]


def token_range(offsets: list[tuple[int, int]], span: tuple[int, int]) -> tuple[int, int]:
    """The tokens [first, last) that overlap the character span."""
    start, end = span
    first = next(i for i, (_, b) in enumerate(offsets) if b > start)
    last = max(i for i, (a, _) in enumerate(offsets) if a < end) + 1
    return first, last


def by_teacher(inference: Any, systems: Sequence[str], tag: str) -> Iterator[tuple[ChunkContext, list[int]]]:
    """(the teacher's context, the indices it serves) per distinct system turn of `systems`, in first-seen order:
    rows sharing a teacher share one prefill, and each context is closed before the next opens."""
    groups: dict[str, list[int]] = {}
    for i, system in enumerate(systems):
        groups.setdefault(system, []).append(i)
    for g, (system, ids) in enumerate(groups.items()):
        with ChunkContext(inference, system, f"{tag}-{g}") as ctx:
            yield ctx, ids
