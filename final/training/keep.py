"""Keeping a partner's answers (`learn --keep-partner`): rows about the partner cartridge beside which a step trains,
taught by the partner alone.

Training beside a partner (final/distill/partners.py) teaches the cartridge to be read past a neighbour: its own
questions, after both caches. Composition fails the other way too: a cartridge's KV changes how the model reads the
neighbour's, and the neighbour's questions are answered worse (bench/RESULTS.md, issue 42). These rows ask about
the partner's own text - quote and cloze rows (final/distill/facts.py) over the whole sentences its first P tokens
hold - and their teacher is the model with the partner's cartridge alone; the student reads them after the two
caches as the step serves them, so the loss is zero exactly when our KV leaves the partner's answers unchanged.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import torch

from final.training.rows import Conversation
from final.training.document.facts import FactConfig, end_of_turn, fact_prompts, prompt_ids
from final.training.document.sentences import sentences
from final.prompts import document_text_held


def held_sentences(tokenizer: Any, text: str, tokens: int) -> str:
    """The whole sentences of `text` that a `tokens`-token cartridge of it holds ("" when not one fits)."""
    held = len(document_text_held(tokenizer, text, tokens))
    return text[:max((end for _, end in sentences(text) if end <= held), default=0)]


@torch.no_grad()
def keep_rows(student: Any, tokenizer: Any, text: str, kv: tuple, tokens: int, top_k: int = 20,
              seed: int = 0) -> list[Conversation]:
    """Fact rows about the partner `text` whose `tokens`-token cartridge is `kv` (keys, values), every token after
    the system turn scored by the model reading that cartridge alone (its top-k), as the student will read it."""
    held = held_sentences(tokenizer, text, tokens)
    if not held:
        return []
    end = end_of_turn(tokenizer)
    rows = []
    for i, fp in enumerate(fact_prompts(held, FactConfig(seed=seed))):
        q, a = prompt_ids(tokenizer, fp, end)
        ids = torch.tensor([q + a], device=student.device)
        where = torch.zeros_like(ids, dtype=torch.bool)
        where[0, :-1] = True  # targets from the row's second token on, as fact rows (target_start=1)
        top = student.log_probs(kv[0], kv[1], ids, where).topk(top_k, dim=-1)
        rows.append(Conversation(i, q, a, top.indices.tolist(), top.values.tolist(), "keep", fp.question,
                                 fp.answer, (0, 0), 1))
    return rows


def keep_pick(rows: Sequence[Conversation], step: int, count: int, seed: int) -> list[Conversation]:
    """A step's `count` rows about its partner: seeded by step, so a resumed run keeps the same answers."""
    rng = random.Random(f"{seed}/keep/{step}")
    return rng.sample(list(rows), min(count, len(rows)))
