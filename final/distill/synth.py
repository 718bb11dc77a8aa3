"""Self-study synthesis (the cartridges repo's `synthesizers/self_study.py`), through InferenceEngine.

Per batch: a chunk of the document (a window of `chunk_tokens`) goes in a system turn; the model, prompted with a
seed instruction (structuring, summarization, question, use case, creative), writes a user message at T≈0.6;
then it answers that message with the chunk in context (the teacher, T=0 by default), keeping the top-k logprobs of
every answer token. Rows are appended to a JSONL file (final/distill/convs.py) batch by batch; a rerun skips
the ids already there, so a killed run resumes.

On the local backend the chunk is prefilled once per batch and served as a cartridge (exact: a cartridge stands for
its text, see build.verify); other backends get the chunk as text in the system turn. Either way the tokens the
model sees are the same: `document_ids(chunk) + continuation_ids(messages)`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from final.distill.convs import Conversation, append, done_ids
from final.errors import CartridgeError
from final.prompts import continuation_ids, document_ids

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


@dataclass
class SynthConfig:
    count: int = 64  # conversations in the file when done
    batch: int = 16  # conversations per chunk (one generate call each for questions and answers)
    chunk_tokens: int = 1024
    question_tokens: int = 64
    answer_tokens: int = 128
    top_k: int = 20
    question_temperature: float = 0.6
    answer_temperature: float = 0.0
    seed: int = 0
    seed_types: tuple[str, ...] = SEED_TYPES

    def check(self) -> None:
        for key in ("count", "batch", "chunk_tokens", "question_tokens", "answer_tokens", "top_k"):
            if getattr(self, key) < 1:
                raise CartridgeError(f"must be at least 1, got {getattr(self, key)}", field=key)
        unknown = sorted(set(self.seed_types) - set(SEED_TYPES))
        if unknown or not self.seed_types:
            raise CartridgeError(f"unknown seed types {unknown}; choose from {list(SEED_TYPES)}", field="seed_types")


def synthesize(inference: Any, text: str, out: str | Path, cfg: SynthConfig, progress: bool = True) -> int:
    """Append conversations to `out` until it holds ids 0..count-1; returns how many were written now."""
    cfg.check()
    out = Path(out)
    tok = inference.tokenizer
    doc = tok(text, add_special_tokens=False).input_ids
    if not doc:
        raise CartridgeError("document text is empty", field="text")
    have = done_ids(out)
    batches = [b for b in range((cfg.count + cfg.batch - 1) // cfg.batch)
               if any(i not in have for i in _batch_ids(b, cfg))]
    from tqdm import tqdm

    written = 0
    for b in tqdm(batches, desc="synth", unit="batch", disable=not progress):
        ids = [i for i in _batch_ids(b, cfg) if i not in have]
        rows = _synth_batch(inference, doc, b, ids, cfg)
        append(out, rows)
        written += len(rows)
    return written


def _batch_ids(b: int, cfg: SynthConfig) -> range:
    return range(b * cfg.batch, min((b + 1) * cfg.batch, cfg.count))


def _synth_batch(inference: Any, doc: list[int], b: int, ids: list[int], cfg: SynthConfig) -> list[Conversation]:
    """One chunk, its questions (sampled), then the teacher's answers with top-k logprobs."""
    rng = random.Random(f"{cfg.seed}/{b}")  # a batch's chunk and seed prompts depend on (seed, batch) only
    start = rng.randrange(0, len(doc) - cfg.chunk_tokens + 1) if len(doc) > cfg.chunk_tokens else 0
    window = (start, min(len(doc), start + cfg.chunk_tokens))
    chunk = inference.tokenizer.decode(doc[window[0]:window[1]])
    kinds = {i: rng.choice(cfg.seed_types) for i in _batch_ids(b, cfg)}
    seeds = {i: seed_prompt(kinds[i], rng) for i in _batch_ids(b, cfg)}
    with _ChunkContext(inference, chunk, f"__synth-{cfg.seed}-{b}") as ctx:
        asked = ctx.generate([[{"role": "user", "content": seeds[i]}] for i in ids],
                             temperature=cfg.question_temperature, max_tokens=cfg.question_tokens,
                             seed=cfg.seed * 1_000_003 + b * 1009)
        questions = [q.strip() for q in asked.completions]
        convs = [[{"role": "user", "content": q}] for q in questions]
        answers = ctx.generate(convs, temperature=cfg.answer_temperature, max_tokens=cfg.answer_tokens,
                               top_logprobs=cfg.top_k, seed=cfg.seed * 1_000_003 + b * 1009 + 1)
    rows = []
    tok = inference.tokenizer
    for i, q, conv, text, meta in zip(ids, questions, convs, answers.completions, answers.metadata):
        tops = meta["top_logprobs"]
        rows.append(Conversation(
            id=i, prompt_ids=continuation_ids(tok, conv), answer_ids=list(meta["response_ids"]),
            top_ids=[[t for t, _ in top] for top in tops], top_logprobs=[[lp for _, lp in top] for top in tops],
            seed_type=kinds[i], question=q, answer=text, chunk=window))
    return rows


class _ChunkContext:
    """Generate with the chunk in a system turn: as a cartridge where the engine runs here, else as text."""

    def __init__(self, inference: Any, chunk: str, cartridge_id: str):
        self.inference, self.chunk, self.cid = inference, chunk, cartridge_id
        self.loaded = False

    def __enter__(self) -> "_ChunkContext":
        engine = self.inference.engine
        if engine is not None and self.inference.cartridges is not None:
            from final.cartridges.build import build_from_text

            cart = build_from_text(engine, document_ids(self.inference.tokenizer, self.chunk))
            self.inference.cartridges.add(self.cid, cart, pin=True)
            self.loaded = True
        return self

    def generate(self, conversations: list[list[dict]], **sampling: Any) -> Any:
        if self.loaded:
            return self.inference.generate(conversations, cartridge=self.cid, **sampling)
        system = {"role": "system", "content": self.chunk}
        return self.inference.generate([[system, *c] for c in conversations], **sampling)

    def __exit__(self, *exc: Any) -> None:
        if self.loaded:
            self.inference.cartridges.unpin(self.cid)
            self.inference.unload_cartridge(self.cid)
