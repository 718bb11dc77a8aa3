"""Training a cartridge to be served beside others (`cartridge=[a, b]`): partner texts, and rows about a partner.

A cartridge trained alone sees its questions right after its own KV; composed, each one's questions come after the
other's KV too, and it loses answers there (bench/RESULTS.md, "Composition"). So half of `learn`'s steps serve it
beside a partner - the cartridge of a short text the model writes itself (partner_texts: nothing downloaded,
nothing from the user's data; greedy, so a resumed run trains beside the same ones), in front of it or after it.
And the failure goes the other way too: our KV changes how the model reads the neighbour's. At those steps the
partner's own rows (keep_rows: quote and cloze rows over the sentences its first P tokens hold, taught by the
partner alone) are trained to keep their answers, read after both caches as the step serves them.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import torch

from final.prompts import document_text_held
from final.training.document.facts import end_of_turn, fact_prompts, prompt_ids
from final.training.document.sentences import sentences
from final.training.rows import Conversation
from final.training.settings import FactConfig

PARTNERS = 4  # partner texts written for a run that trains beside partners
# Local-history subjects like the documents cartridges are made of, none of them the QA sets' documents.
TOPICS = ("the history of a small fishing harbour", "a family-run wool mill", "an old hilltop observatory",
          "a village lending library", "a canal lock and its keepers", "a country brewery",
          "a coastal lighthouse", "a market town's clock tower")


def partner_texts(inference: Any, count: int, tokens: int) -> list[str]:
    """`count` short articles by the model (greedy), each long enough for a `tokens`-token cartridge."""
    topics = [TOPICS[i % len(TOPICS)] for i in range(count)]
    out = inference.generate([[{"role": "user", "content": f"Write a short encyclopedia article about {t}."}]
                              for t in topics], temperature=0.0, max_tokens=tokens + 32)
    return [text for text in out.completions if text.strip()]


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
