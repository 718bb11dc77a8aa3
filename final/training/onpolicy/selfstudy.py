"""Self-study synthesis (the cartridges repo's `synthesizers/self_study.py`), through InferenceEngine.

Per batch, as the repo does it: a chunk of the document (a window of between `min_chunk_tokens` and
`max_chunk_tokens`, drawn per batch) wrapped in the repo's system-prompt template goes in a system turn; the model,
prompted with a seed instruction (structuring, summarization, question, use case, creative), writes a user message
at T=0.6, to which a chain-of-thought instruction is added with probability `cot_probability` (the repo's
`prob_cot_a`); then it answers that message with the chunk in context (the teacher, T=0). The teacher's top-k
logprobs are then taken at every position after the system turn (`supervise="all"`, the repo's: its logprobs start
at the first message), so the question's tokens, which carry the document's names and dates, are targets too;
`supervise="answer"` keeps the answer's only. Rows are appended to a JSONL file (final/distill/convs.py) batch
by batch; a rerun skips the ids already there, so a killed run resumes.

On the local backend the chunk is prefilled once per batch and served as a cartridge (exact: a cartridge stands for
its text, see build.verify); other backends get the chunk as text in the system turn. Either way the tokens the
model sees are the same: `document_ids(chunk) + continuation_ids(messages)`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from final.training.rows import Conversation, append, done_ids
from final.training.teacher import ChunkContext
from final.errors import CartridgeError
from final.prompts import continuation_ids

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
SUPERVISE = ("all", "answer")

SEED_TYPES = ("structuring", "summarization", "question", "use_case", "creative")
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


def system_text(chunk: str, template: str | None = SYSTEM_TEMPLATE) -> str:
    """The question writer's system turn for a chunk (self-study's, in the repo's template by default)."""
    return template.format(subcorpus=chunk) if template else chunk



@dataclass
class SynthConfig:
    count: int = 64  # conversations in the file when done
    batch: int = 16  # conversations per chunk (one generate call each for questions and answers)
    min_chunk_tokens: int = 512  # the repo draws each chunk's length in [512, 4096]
    max_chunk_tokens: int = 2048
    question_tokens: int = 128  # the repo allows 512 and 1024: a 2-core CPU pays for every token (flags raise them)
    answer_tokens: int = 256
    top_k: int = 20
    question_temperature: float = 0.6
    answer_temperature: float = 0.0
    cot_probability: float = 0.2
    supervise: str = "all"
    template: str | None = SYSTEM_TEMPLATE
    seed: int = 0
    seed_types: tuple[str, ...] = SEED_TYPES

    def check(self) -> None:
        for key in ("count", "batch", "min_chunk_tokens", "max_chunk_tokens", "question_tokens", "answer_tokens",
                    "top_k"):
            if getattr(self, key) < 1:
                raise CartridgeError(f"must be at least 1, got {getattr(self, key)}", field=key)
        if self.min_chunk_tokens > self.max_chunk_tokens:
            raise CartridgeError(f"min {self.min_chunk_tokens} is above max {self.max_chunk_tokens}",
                                 field="chunk_tokens")
        if not 0 <= self.cot_probability <= 1:
            raise CartridgeError(f"must be in [0, 1], got {self.cot_probability}", field="cot_probability")
        if self.supervise not in SUPERVISE:
            raise CartridgeError(f"must be one of {list(SUPERVISE)}, got {self.supervise!r}", field="supervise")
        if self.template is not None and "{subcorpus}" not in self.template:
            raise CartridgeError("must contain {subcorpus}", field="template")
        unknown = sorted(set(self.seed_types) - set(SEED_TYPES))
        if unknown or not self.seed_types:
            raise CartridgeError(f"unknown seed types {unknown}; choose from {list(SEED_TYPES)}", field="seed_types")


def synthesize(inference: Any, text: str, out: str | Path, cfg: SynthConfig, progress: bool = True) -> int:
    """Append conversations to `out` until it holds ids 0..count-1; returns how many were written now."""
    cfg.check()
    out = Path(out)
    doc = inference.tokenizer(text, add_special_tokens=False).input_ids
    if not doc:
        raise CartridgeError("document text is empty", field="text")
    have = done_ids(out)
    batches = [b for b in range((cfg.count + cfg.batch - 1) // cfg.batch)
               if any(i not in have for i in _batch_ids(b, cfg))]
    from tqdm import tqdm

    written = 0
    for b in tqdm(batches, desc="synth", unit="batch", disable=not progress):
        ids = [i for i in _batch_ids(b, cfg) if i not in have]
        rows = synth_batch(inference, doc, b, ids, cfg)
        append(out, rows)
        written += len(rows)
    return written


def _batch_ids(b: int, cfg: SynthConfig) -> range:
    return range(b * cfg.batch, min((b + 1) * cfg.batch, cfg.count))


@dataclass
class Plan:
    """One batch's draws: its chunk window and, per conversation id, the seed type, seed prompt and CoT choice."""
    window: tuple[int, int]
    kinds: dict[int, str]
    seeds: dict[int, str]
    cot: dict[int, str | None]


def plan_batch(doc_len: int, b: int, ids: Sequence[int], cfg: SynthConfig) -> Plan:
    """A batch's chunk and seed prompts depend on (seed, batch) only, so a resumed run draws the same ones."""
    rng = random.Random(f"{cfg.seed}/{b}")
    size = min(doc_len, rng.randint(cfg.min_chunk_tokens, cfg.max_chunk_tokens))
    start = rng.randrange(0, doc_len - size + 1)
    kinds = {i: rng.choice(cfg.seed_types) for i in ids}
    seeds = {i: seed_prompt(kinds[i], rng) for i in ids}
    cot = {i: rng.choice(COT_INSTRUCTIONS) if rng.random() < cfg.cot_probability else None for i in ids}
    return Plan((start, start + size), kinds, seeds, cot)


def ask(ctx: "ChunkContext", plan: Plan, ids: Sequence[int], cfg: SynthConfig, seed: int) -> list[str]:
    """The questions (user messages) the model writes for the seed prompts, CoT instructions added."""
    asked = ctx.generate([[{"role": "user", "content": plan.seeds[i]}] for i in ids],
                         temperature=cfg.question_temperature, max_tokens=cfg.question_tokens, seed=seed)
    return [q.strip() + (f"\n\n{plan.cot[i]}" if plan.cot[i] else "") for i, q in zip(ids, asked.completions)]


def synth_batch(inference: Any, doc: list[int], b: int, ids: list[int], cfg: SynthConfig) -> list[Conversation]:
    """One chunk, its questions (sampled), the teacher's answers, then the teacher's top-k at every target."""
    plan = plan_batch(len(doc), b, _batch_ids(b, cfg), cfg)
    tok = inference.tokenizer
    chunk = system_text(tok.decode(doc[plan.window[0]:plan.window[1]]), cfg.template)
    seed = cfg.seed * 1_000_003 + b * 1009
    with ChunkContext(inference, chunk, f"__synth-{cfg.seed}-{b}") as ctx:
        questions = ask(ctx, plan, ids, cfg, seed)
        prompts = [continuation_ids(tok, [{"role": "user", "content": q}]) for q in questions]
        answers = ctx.generate(prompts, temperature=cfg.answer_temperature, max_tokens=cfg.answer_tokens,
                               seed=seed + 1)
        targets = [tops for tops, _ in ctx.teacher_scores(prompts, answers.token_ids, cfg.top_k)]
    rows = []
    for i, q, prompt, answer, text, tops in zip(ids, questions, prompts, answers.token_ids, answers.completions,
                                                targets):
        start = 1 if cfg.supervise == "all" else len(prompt)
        tops = tops[start - 1:]
        rows.append(Conversation(
            id=i, prompt_ids=prompt, answer_ids=list(answer), top_ids=[[t for t, _ in top] for top in tops],
            top_logprobs=[[lp for _, lp in top] for top in tops], seed_type=plan.kinds[i], question=q, answer=text,
            chunk=plan.window, target_start=start))
    return rows


