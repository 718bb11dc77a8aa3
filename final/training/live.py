"""On-policy fact rows: the cartridge being trained answers the fact questions itself, and each answer is scored by
its own row's teacher (GKD's on-policy data, over the questions `learn` asks rather than self-study's).

Why (bench/RESULTS.md, issue 42, the long document): a cartridge trained on fact rows fits them teacher-forced (its
top-1 is the document's token 91% of the time, the teacher's 92%) yet, answering the same questions freely, names
the fact a third as often as the teacher: the rows teach it to continue the document's sentences once begun, never
what to do from its own first, wrong, words. Here, at every step, `count` fact questions (seeded by the step) are
answered by the base model with the *current* cartridge (in-process, the cartridge replaced in memory each step,
as `distill` samples), and the teacher - the model with the document, or with the row's `teacher_tokens` window
of it, as its system turn (facts.fact_rows' teacher) - scores the answer token by token (top-k logprobs, and its
logprob of the sampled token for the reverse losses). The rows are marked `sampled`, so the loss treats their
answers as the student's own (losses.step_loss) and `--hard` never applies to them.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from final.training.rows import Conversation
from final.training.document.facts import FactConfig, closed_answer, end_of_turn, fact_prompts, prompt_ids, teacher_systems
from final.training.teacher import by_teacher, token_offsets, token_range
from final.errors import CartridgeError


@dataclass
class LiveConfig:
    temperature: float = 1.0  # the student's sampling temperature (GKD samples at 1)
    answer_tokens: int = 64  # the most tokens of a sampled answer

    def check(self) -> None:
        if not self.temperature > 0:
            raise CartridgeError(f"must be a positive number, got {self.temperature}", field="sample_temperature")
        if self.answer_tokens < 1:
            raise CartridgeError(f"must be at least 1, got {self.answer_tokens}", field="sample_tokens")


class LiveFacts:
    """A source of on-policy rows for train(): `rows(step, count, cache)`. Needs an in-process engine (the
    cartridge is replaced in its store every step, nothing is written to disk)."""

    CARTRIDGE = "__learn-student"

    def __init__(self, inference: Any, text: str, facts: FactConfig, live: LiveConfig):
        facts.check()
        live.check()
        if inference.cartridges is None:
            raise CartridgeError("on-policy rows need the embedded engine (an in-process cartridge store)",
                                 field="on_policy")
        self.inference, self.facts, self.live = inference, facts, live
        tok = inference.tokenizer
        self.prompts = fact_prompts(text, facts)
        if not self.prompts:
            raise CartridgeError("the document has no sentences to ask about", field="text")
        self.end = end_of_turn(tok)
        offsets = token_offsets(tok, text)
        self.systems = teacher_systems(tok, text, self.prompts, facts, offsets)
        self.asked = [prompt_ids(tok, fp, self.end)[0] for fp in self.prompts]
        self.spans = [token_range(offsets, fp.span) for fp in self.prompts]

    def key(self) -> dict:
        """How the rows are sampled: a checkpoint resumes only with the same (train()'s resume key)."""
        return asdict(self.live)

    def pick(self, step: int, count: int) -> list[int]:
        """The step's questions: seeded by (seed, step), so a resumed run asks the same ones."""
        rng = random.Random(f"{self.facts.seed}/live/{step}")
        return rng.sample(range(len(self.prompts)), min(count, len(self.prompts)))

    def rows(self, step: int, count: int, cache: Any) -> tuple[list[Conversation], dict]:
        """`count` rows answered by the student with `cache` (student.TrainableKV) as it is now, and the seconds."""
        t0 = time.perf_counter()
        self.inference.cartridges.add(self.CARTRIDGE, cache.cartridge(), pin=True)
        picked = self.pick(step, count)
        out = self.inference.generate([self.asked[i] for i in picked], cartridge=self.CARTRIDGE,
                                      temperature=self.live.temperature, max_tokens=self.live.answer_tokens,
                                      seed=self.facts.seed * 1_000_003 + step)
        answers = {i: closed_answer(row, self.end) for i, row in zip(picked, out.rows())}
        t1 = time.perf_counter()
        rows = self._scored(answers)
        info = {"rollout_s": t1 - t0, "teacher_s": time.perf_counter() - t1,
                "samples": [rows[i].answer for i in picked]}
        return [rows[i] for i in picked], info

    def _scored(self, answers: dict[int, list[int]]) -> dict[int, Conversation]:
        """Each answer scored by its row's teacher (rows sharing a system turn share one prefill); the answer's
        tokens are the targets (the question's are the fact rows' already)."""
        picked = list(answers)
        rows = {}
        for ctx, ids in by_teacher(self.inference, [self.systems[i] for i in picked], "__live-teacher"):
            ids = [picked[j] for j in ids]
            scored = ctx.teacher_scores([self.asked[i] for i in ids], [answers[i] for i in ids], self.facts.top_k)
            for i, (tops, lps) in zip(ids, scored):
                start, fp = len(self.asked[i]), self.prompts[i]
                rows[i] = Conversation(
                    i, self.asked[i], answers[i], top_ids=[[t for t, _ in top] for top in tops[start - 1:]],
                    top_logprobs=[[lp for _, lp in top] for top in tops[start - 1:]], seed_type=f"live-{fp.kind}",
                    question=fp.question, answer=self.inference.tokenizer.decode(answers[i], skip_special_tokens=True),
                    chunk=self.spans[i], target_start=start, sampled=True, token_logprobs=lps[start - 1:])
        return rows

    def close(self) -> None:
        if self.CARTRIDGE in (self.inference.cartridge_ids() or []):
            self.inference.cartridges.unpin(self.CARTRIDGE)
            self.inference.unload_cartridge(self.CARTRIDGE)
