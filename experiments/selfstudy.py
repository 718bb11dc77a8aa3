"""Self-study as a way to make training rows (`final cartridge synth` as it was at c7fd7bc): the model writes
questions about chunks of the document (final.training.onpolicy.selfstudy: the cartridges repo's seed prompts), the
teacher - the chunk in the repo's template, as its system turn - answers them at T=0, and its top-k logprobs at every
token after the system turn are the targets. Rows go to a JSONL file `final cartridge train` reads; a rerun appends
only the ids not written yet.

Why it left the product: a 135M model's questions are vague or invented, and a cartridge trained on them learns the
teacher's style of answer, not the facts (bench/RESULTS.md, "Trained cartridges"; `learn`'s fact rows instead).

    .venv/bin/python experiments/selfstudy.py --text doc.txt --out rows.jsonl [--count 64] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from final.cartridges.build import read_document
from final.errors import CartridgeError
from final.inf import local_engine
from final.models import DEFAULT_MODEL
from final.prompts import continuation_ids
from final.training.onpolicy.selfstudy import ask, plan_batch, system_text
from final.training.rows import Conversation, append
from final.training.settings import SynthConfig
from final.training.teacher import ChunkContext


@dataclass
class SelfStudy:
    count: int = 64  # conversations in the file when done
    batch: int = 16  # conversations per chunk (one generate call each for questions and answers)
    answer_tokens: int = 256
    top_k: int = 20
    answer_temperature: float = 0.0
    supervise: str = "all"  # "all": every token after the system turn (the repo's); "answer": the answer's only
    seed: int = 0
    questions: SynthConfig = field(default_factory=lambda: SynthConfig(question_tokens=128))

    def check(self) -> None:
        for key in ("count", "batch", "answer_tokens", "top_k"):
            if getattr(self, key) < 1:
                raise CartridgeError(f"must be at least 1, got {getattr(self, key)}", field=key)
        if self.supervise not in ("all", "answer"):
            raise CartridgeError(f"must be all or answer, got {self.supervise!r}", field="supervise")
        self.questions.check()


def done_ids(path: Path) -> set[int]:
    """Ids already written (a resumed synthesis skips them); a torn last line from a crash is ignored."""
    if not path.is_file():
        return set()
    ids = set()
    for line in path.read_text().splitlines():
        try:
            ids.add(int(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError):
            continue
    return ids


def synthesize(inference: Any, text: str, out: str | Path, cfg: SelfStudy, progress: bool = True) -> int:
    """Append conversations to `out` until it holds ids 0..count-1; returns how many were written now."""
    cfg.check()
    out = Path(out)
    doc = inference.tokenizer(text, add_special_tokens=False).input_ids
    if not doc:
        raise CartridgeError("document text is empty", field="text")
    have = done_ids(out)
    batches = [b for b in range((cfg.count + cfg.batch - 1) // cfg.batch)
               if any(i not in have for i in _batch_ids(b, cfg))]
    written = 0
    for b in tqdm(batches, desc="synth", unit="batch", disable=not progress):
        rows = synth_batch(inference, doc, b, [i for i in _batch_ids(b, cfg) if i not in have], cfg)
        append(out, rows)
        written += len(rows)
    return written


def _batch_ids(b: int, cfg: SelfStudy) -> range:
    return range(b * cfg.batch, min((b + 1) * cfg.batch, cfg.count))


def synth_batch(inference: Any, doc: list[int], b: int, ids: list[int], cfg: SelfStudy) -> list[Conversation]:
    """One chunk, its questions (sampled), the teacher's answers, then the teacher's top-k at every target."""
    plan = plan_batch(len(doc), b, _batch_ids(b, cfg), cfg.questions, cfg.seed)
    tok = inference.tokenizer
    seed = cfg.seed * 1_000_003 + b * 1009
    with ChunkContext(inference, system_text(tok.decode(doc[plan.window[0]:plan.window[1]])),
                      f"__synth-{cfg.seed}-{b}") as ctx:
        questions = ask(ctx, plan, ids, cfg.questions, seed)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--text", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--count", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="another seed: held-out questions")
    p.add_argument("--supervise", choices=("all", "answer"), default="all")
    p.add_argument("--model", default=DEFAULT_MODEL)
    args = p.parse_args(argv)
    cfg = SelfStudy(count=args.count, batch=args.batch, seed=args.seed, supervise=args.supervise)
    inference = local_engine(args.model, dtype="float32")
    try:
        written = synthesize(inference, read_document(args.text), args.out, cfg)
    finally:
        inference.shutdown()
    print(json.dumps({"written": written, "out": str(args.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
