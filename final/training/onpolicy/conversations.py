"""The on-policy loop's conversations: a step's questions, a supervised row, and the teacher-answered conversations
the start reads (`observe`) and the validation set is made of (`validation_rows`).

Every draw is a self-study plan batch seeded by (seed, batch): the loop's steps use batches 0, 1, ...; the
initialisation's observation conversations -1, -2, ...; the validation set's -1001, -1002, ... . So none of them
shares a question draw, and a resumed run makes the same validation set again.
"""

from __future__ import annotations

from typing import Any

from final.training.rows import Conversation
from final.training.onpolicy.selfstudy import Plan, ask, plan_batch, system_text
from final.training.teacher import ChunkContext
from final.training.train import Batch, make_batch
from final.prompts import continuation_ids

VALIDATION_BATCH = -1001  # the validation set's first plan batch (observe's are -1, -2, ...)
# two questions a chunk: 8 from one chunk judged a run the opposite way to the 48 held-out rows from 6 chunks
# (bench/HISTORY.md, "Sixth pass ...: fit the values"): a few of a chunk's facts carry most of a set's KL
VALIDATION_PER_CHUNK = 2


def ask_batch(inference: Any, doc: list[int], step: int, ids: list[int],
              cfg: Any) -> tuple[Plan, list[str], list[list[int]]]:
    """A step's questions (self-study's plan for batch `step`, written with the chunk in context) and their ids."""
    tok = inference.tokenizer
    plan = plan_batch(len(doc), step, ids, cfg.synth, cfg.seed)
    chunk = system_text(tok.decode(doc[plan.window[0]:plan.window[1]]))
    with ChunkContext(inference, chunk, f"__distill-chunk-{step}") as ctx:
        questions = ask(ctx, plan, ids, cfg.synth, cfg.seed * 1_000_003 + step * 1009)
    return plan, questions, [continuation_ids(tok, [{"role": "user", "content": q}]) for q in questions]


def make_row(q: int, prompt: list[int], answer: list[int], tops: list, question: str, kind: str,
             window: tuple[int, int], answer_only: bool = False) -> Conversation:
    """A supervised row: every token after the system turn (the repo's; the question's names are targets too) or,
    `answer_only`, the answer's, with the teacher's top-k (tops: one [(id, logprob)] per prompt + answer token
    after the first)."""
    start = len(prompt) if answer_only else 1
    tops = tops[start - 1:]
    return Conversation(q, prompt, answer, [[t for t, _ in top] for top in tops],
                        [[lp for _, lp in top] for top in tops], kind, question, "", window, start)


def teacher_answered(inference: Any, teacher: ChunkContext, doc: list[int], cfg: Any, count: int,
                     first_batch: int, per_batch: int) -> tuple[list[str], list[list[int]], list[list[int]]]:
    """`count` questions drawn as a step's, `per_batch` from each plan batch (first_batch, first_batch - 1, ...:
    each its own chunk of the document), and the teacher's greedy answers: (questions, prompt ids, answer ids)."""
    questions: list[str] = []
    prompts: list[list[int]] = []
    answers: list[list[int]] = []
    batch = first_batch
    while len(prompts) < count:
        ids = list(range(min(per_batch, count - len(prompts))))
        _, asked, asked_ids = ask_batch(inference, doc, batch, ids, cfg)
        out = teacher.generate(asked_ids, temperature=0.0, max_tokens=cfg.answer_tokens)
        questions += asked
        prompts += asked_ids
        answers += [list(a) for a in out.token_ids]
        batch -= 1
    return questions, prompts, answers


def observe(inference: Any, teacher: ChunkContext, doc: list[int], cfg: Any) -> tuple[list[str], list[list[int]]]:
    """init_questions self-study questions (from batches -1, -2, ...: never a step's own) and the teacher's greedy
    answers: (questions, prompt + answer ids per conversation)."""
    questions, prompts, answers = teacher_answered(inference, teacher, doc, cfg, cfg.init_questions, -1,
                                                   cfg.questions)
    return questions, [p + a for p, a in zip(prompts, answers)]


def validation_rows(inference: Any, teacher: ChunkContext, doc: list[int], cfg: Any, pad_id: int,
                    device: Any) -> tuple[list[str], Batch | None]:
    """cfg.validate teacher-answered conversations (two a chunk), never trained on, as a batch whose forward KL
    (answer tokens, against the teacher's top-k) judges the cartridge between steps; None when cfg.validate is 0."""
    if not cfg.validate:
        return [], None
    questions, prompts, answers = teacher_answered(inference, teacher, doc, cfg, cfg.validate, VALIDATION_BATCH,
                                                   VALIDATION_PER_CHUNK)
    scored = teacher.teacher_scores(prompts, answers, cfg.top_k)
    # judged on what the model says: the answers' tokens only
    rows = [make_row(i, p, a, tops, questions[i], "validation", (0, len(doc)), answer_only=True)
            for i, (p, a, (tops, _)) in enumerate(zip(prompts, answers, scored)) if a]
    return questions, make_batch(rows, pad_id, device) if rows else None
