"""Self-study's questions (the cartridges repo's `synthesizers/self_study.py`): how the on-policy loop asks.

Per step, as the repo does it: a chunk of the document (a window of between `min_chunk_tokens` and
`max_chunk_tokens`, drawn per step) wrapped in the repo's system-prompt template goes in a system turn; the model,
prompted with a seed instruction (structuring, summarization, question, use case, creative), writes a user message
at T=0.6, to which a chain-of-thought instruction is added with probability `cot_probability` (the repo's
`prob_cot_a`). Every draw depends on (seed, batch) only, so a resumed run asks the same questions. Self-study as a
way to make training rows (`synth`, then `train`) lost to `learn`'s fact rows: experiments/selfstudy.py keeps it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from final.training.settings import SynthConfig
from final.training.teacher import ChunkContext

# The cartridges repo's SYSTEM_PROMPT_TEMPLATE (synthesizers/self_study.py): the teacher's view of a chunk.
SYSTEM_TEMPLATE = (
    "You are in a conversation about the corpus of information below. Note that some of the corpus has been omitted "
    "to fit within the context window.\nWhen you talk about the passage, do not start your responses with "
    "\"According to the passage\", \"In the passage\", or any other similar phrase. Just start with the content of "
    "your response.\n\n<corpus>\n{subcorpus}\n</corpus>\n")
# The repo's COT_INSTRUCTIONS, a few of them: appended to a question with probability cot_probability.
COT_INSTRUCTIONS = (
    "If helpful, you can think before responding. Put your thinking between <thinking> and </thinking> tags. Then, "
    "provide your final response between <response> and </response> tags.",
    "Respond in the following format: <thinking>...</thinking> <response>...</response>",
    "Explain your reasoning before providing your final response.",
    "Explain your reasonining between <reasoning> and </reasoning> tags.",
    "Provide your final answer within <answer>...</answer> tags. Optionally, you can explain your reasoning between "
    "<reasoning> and </reasoning> tags.",
    "Think carefully before answering. Put your process in <process>...</process> and your solution in "
    "<solution>...</solution>.",
)
_FORMATS = ("JSON", "YAML", "TOML", "INI", "XML", "plain text")
# Condensed from the cartridges repo's seed prompt generators (synthesizers/self_study.py).
_SEEDS: dict[str, tuple[str, ...]] = {
    "structuring": ("Please generate a single chat message instructing an LLM to structure the information in a "
                    "section of the corpus above in the following format: {fmt}. Be sure to ask for precise "
                    "information like dates, names and numerical values. Output only the chat message itself.",),
    "summarization": ("Please generate a single chat message instructing an LLM to summarize part of the corpus "
                      "above. Make the instruction explicit about which section to summarize, with details "
                      "(names, titles, dates) that make it clear. Output only the chat message itself.",),
    "question": ("Generate a question for an LLM that will test its knowledge of the information in the corpus "
                 "above. Include details (names, titles, dates, etc.) that make it clear what you are asking about. "
                 "Output only a single question.",
                 "You are helping to quiz a user about the information in the corpus. Please generate a question "
                 "about the corpus above. Answer only with the question, do not include any other text."),
    "use_case": ("Think about a practical, real-world task someone could accomplish with the knowledge in the corpus "
                 "above, then write the question or instruction such a user would send to an LLM. Output only "
                 "a single question.",),
    "creative": ("You are having a creative conversation inspired by the information in the corpus above. Please "
                 "generate a question for your conversation partner to start off the discussion. Answer only with "
                 "the question.",),
}


def seed_prompt(kind: str, rng: random.Random) -> str:
    return rng.choice(_SEEDS[kind]).format(fmt=rng.choice(_FORMATS))


def system_text(chunk: str) -> str:
    """The question writer's system turn for a chunk, in the repo's template."""
    return SYSTEM_TEMPLATE.format(subcorpus=chunk)


@dataclass
class Plan:
    """One batch's draws: its chunk window and, per conversation id, the seed type, seed prompt and CoT choice."""
    window: tuple[int, int]
    kinds: dict[int, str]
    seeds: dict[int, str]
    cot: dict[int, str | None]


def plan_batch(doc_len: int, b: int, ids: Sequence[int], cfg: SynthConfig, seed: int) -> Plan:
    """A batch's chunk and seed prompts depend on (seed, batch) only, so a resumed run draws the same ones."""
    rng = random.Random(f"{seed}/{b}")
    size = min(doc_len, rng.randint(cfg.min_chunk_tokens, cfg.max_chunk_tokens))
    start = rng.randrange(0, doc_len - size + 1)
    kinds = {i: rng.choice(cfg.seed_types) for i in ids}
    seeds = {i: seed_prompt(kinds[i], rng) for i in ids}
    cot = {i: rng.choice(COT_INSTRUCTIONS) if rng.random() < cfg.cot_probability else None for i in ids}
    return Plan((start, start + size), kinds, seeds, cot)


def ask(ctx: ChunkContext, plan: Plan, ids: Sequence[int], cfg: SynthConfig, seed: int) -> list[str]:
    """The questions (user messages) the model writes for the seed prompts, CoT instructions added."""
    asked = ctx.generate([[{"role": "user", "content": plan.seeds[i]}] for i in ids],
                         temperature=cfg.question_temperature, max_tokens=cfg.question_tokens, seed=seed)
    return [q.strip() + (f"\n\n{plan.cot[i]}" if plan.cot[i] else "") for i, q in zip(ids, asked.completions)]
