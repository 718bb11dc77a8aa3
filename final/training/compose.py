"""Partner texts: stand-ins for the other cartridges a trained one will be served beside.

A cartridge trained alone sees its questions right after its own KV; served as `cartridge=[a, b]`, each one's
questions come after the other's KV too, and `learn` cartridges lose 30-40% of their accuracy there (bench/RESULTS.md,
issue 42). Training some steps beside another cartridge teaches the KV to be read past a neighbour. The neighbours
a user will compose are unknown at training time, so the partners are short documents the model writes itself
(nothing to download, nothing from the user's data): their first P tokens, as a cartridge of text, in front of or
after the trained KV. Greedy, so the same model writes the same partners and a resumed run trains beside them again.
"""

from __future__ import annotations

from typing import Any

# Local-history subjects like the documents cartridges are made of, none of them the bench's QA documents'.
TOPICS = ("the history of a small fishing harbour", "a family-run wool mill", "an old hilltop observatory",
          "a village lending library", "a canal lock and its keepers", "a country brewery",
          "a coastal lighthouse", "a market town's clock tower")


def partner_texts(inference: Any, count: int, tokens: int) -> list[str]:
    """`count` short articles by the model (greedy), each long enough for a `tokens`-token cartridge."""
    topics = [TOPICS[i % len(TOPICS)] for i in range(count)]
    out = inference.generate([[{"role": "user", "content": f"Write a short encyclopedia article about {t}."}]
                              for t in topics], temperature=0.0, max_tokens=tokens + 32)
    return [text for text in out.completions if text.strip()]
