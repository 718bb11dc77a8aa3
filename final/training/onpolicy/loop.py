"""On-policy cartridge distillation: the loop seed 000 was written for, with final as the teacher.

Each step:
  1. questions: a chunk of the document and self-study seed prompts (selfstudy.py, seeded by the step), the
     model writes the user messages with the chunk in context (T=0.6, CoT instructions as the repo);
  2. rollout: the student, the base model with the *current* cartridge, samples answers (T=1 by default, n per
     question) - in-process through InferenceEngine (`rollout="engine"`, the cartridge updated in memory) or
     through veRL's own AgentLoopManager -> the `tokasaurus` replica -> `final serve` (`rollout="verl"`,
     final.training.onpolicy.verl_rollout; the file is re-read at each step through force_redownload);
  3. teacher: the same base model with the whole document as its system turn (teacher.teacher_system: the one
     teacher of training, validation, the `match` start and evaluation; the repo's template only frames the
     question writer's chunk in step 1), served as a cartridge built once and shared by every row, scores every
     token after the system turn with top-k logprobs (InferenceEngine.score: any backend);
  4. gradient: the forward KL over the teacher's top-k and a bucket for the rest (losses.forward_topk_tail) on the
     HF student with the cartridge as its trainable KV prefix; Adam on a cosine lr (RESULTS, "On-policy
     distillation");
  5. sync: the cartridge is written atomically to OUT in the repo's layout (+ manifest) and the next step samples
     with it.
One token stream throughout: the student sees cartridge + continuation_ids(messages) when it samples, when it is
trained, and when it is served (no chat-template default system turn after the cartridge: it stands for that turn).
Every draw is seeded by (seed, step), and the checkpoint (OUT.ckpt) holds cache, optimizer and records, so a
killed run resumes where its last checkpoint was.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from final.cartridges.format import save_cartridge
from final.cartridges.manifest import CartridgeManifest
from final.errors import CartridgeError
from final.models import resolve_model_path
from final.training.onpolicy.conversations import ask_batch, make_row, observe, validation_rows
from final.training.rows import Conversation
from final.training.settings import DistillConfig
from final.training.start.initial import initial_ids, select_start
from final.training.student import Student, TrainableKV
from final.training.teacher import ChunkContext, teacher_system
from final.training.train import make_batch
from final.training.trainer import Trainer, checkpoint_path, digest

LOSS = "forward_topk_tail"  # a true KL: forward_topk made a match start worse (RESULTS, "On-policy distillation")


class StudentSampler:
    """Step 2 in-process: the base model plus the current cartridge, on the same InferenceEngine as the teacher."""

    def __init__(self, inference: Any, out: Path, cid: str):
        self.inference, self.out, self.cid = inference, out, cid

    def sync(self, cart: Any) -> None:
        if self.inference.cartridges is not None:  # the embedded engine: replace the resident copy
            self.inference.cartridges.add(self.cid, cart, pin=True)

    def sample(self, convs: list[list[dict]], prompts: list[list[int]], n: int, seed: int,
               cfg: DistillConfig) -> list[tuple[int, list[int], list[int]]]:
        """(question index, prompt ids, answer ids) per sample, prompt-major."""
        cartridge = self.cid if self.inference.cartridges is not None else [
            {"id": str(self.out), "source": "local", "force_redownload": True}]  # a server re-reads the file
        out = self.inference.generate(prompts, cartridge=cartridge, n=n, temperature=cfg.temperature,
                                      max_tokens=cfg.answer_tokens, seed=seed)
        return [(i // n, prompts[i // n], list(ids)) for i, ids in enumerate(out.token_ids)]

    def close(self) -> None:
        if self.inference.cartridges is not None and self.cid in (self.inference.cartridge_ids() or []):
            self.inference.cartridges.unpin(self.cid)
            self.inference.unload_cartridge(self.cid)


@dataclass
class Run:
    """What one distill() call works with (built once, used by every step)."""
    cfg: DistillConfig
    inference: Any
    doc: list[int]  # the document's tokens (chunks are drawn from them)
    teacher: ChunkContext
    sampler: Any  # StudentSampler or final.training.onpolicy.verl_rollout.VerlRollout
    trainer: Trainer
    pad_id: int


def step_rows(run: Run, step: int) -> tuple[list[Conversation], dict]:
    """Steps 1-3 of one step: its questions, the student's answers, the teacher's targets."""
    cfg = run.cfg
    seed = cfg.seed * 1_000_003 + step * 1009
    t0 = time.perf_counter()
    plan, questions, prompts = ask_batch(run.inference, run.doc, step, list(range(cfg.questions)), cfg)
    convs = [[{"role": "user", "content": q}] for q in questions]
    t1 = time.perf_counter()
    samples = run.sampler.sample(convs, prompts, cfg.n, seed + 1, cfg)
    t2 = time.perf_counter()
    scored = run.teacher.teacher_scores([p for _, p, _ in samples], [a for _, _, a in samples], cfg.top_k)
    rows = [make_row(q, prompt, answer, tops, questions[q], plan.kinds[q], plan.window)
            for (q, prompt, answer), (tops, _) in zip(samples, scored) if answer]
    info = {"question_s": t1 - t0, "rollout_s": t2 - t1, "teacher_s": time.perf_counter() - t2,
            "questions": questions, "samples": [a for _, _, a in samples]}
    return rows, info


def run_step(run: Run, step: int, save: Callable[[Any], Path], first: dict | None = None) -> dict:
    """One whole step: rows, the gradient step, the sync of the new cartridge. `first`: what a fresh run did
    before its first step (the questions of its initialisation and validation set join the step's record, so a
    held-out set can be deduplicated against them; and their seconds)."""
    rows, info = step_rows(run, step)
    if first:
        info = {**info, **first, "questions": first["questions"] + info["questions"]}
    if not rows:
        raise CartridgeError(f"step {step + 1}: every answer was empty; raise --answer-tokens", field="answer_tokens")
    rec = run.trainer.step(make_batch(rows, run.pad_id, run.trainer.student.device), **info,
                           answer_tokens=sum(len(r.answer_ids) for r in rows))
    t0 = time.perf_counter()
    cart = run.trainer.cache.cartridge()
    save(cart)
    run.sampler.sync(cart)
    rec["sync_s"] = time.perf_counter() - t0
    return rec


class VerlSampler:
    """Step 2 through veRL: its AgentLoopManager samples through the replica from `final serve`, which re-reads
    the cartridge file each step (force_redownload); nothing to sync in memory."""

    def __init__(self, rollout: Any):
        self.rollout = rollout

    def sync(self, cart: Any) -> None:
        pass

    def sample(self, convs: list[list[dict]], prompts: list[list[int]], n: int, seed: int,
               cfg: DistillConfig) -> list[tuple[int, list[int], list[int]]]:
        rows = self.rollout.sample(convs, n=n, seed=seed)
        for r in rows:  # the one-token-stream rule: what the server put after the cartridge is what we train on
            if r.prompt_ids != prompts[r.row]:
                raise CartridgeError(f"the veRL rollout of question {r.row} saw other prompt tokens than the "
                                     "student is trained on (a system turn after the cartridge?)", field="rollout")
        return [(r.row, prompts[r.row], list(r.response_ids)) for r in rows]

    def close(self) -> None:
        self.rollout.close()


def distill(inference: Any, text: str, out: str | Path, cfg: DistillConfig, *, model: str, device: str = "cpu",
            dtype: str = "auto", server: str | None = None, progress: bool = True,
            on_step: Callable[[dict, TrainableKV], None] | None = None,
            on_start: Callable[[int, TrainableKV], None] | None = None) -> list[dict]:
    """Run (or resume) the loop for cfg.steps steps; the cartridge is at `out` after every step, and at the end
    the best one the validation set judged (the start included; the last step's when cfg.validate is 0). Returns
    every step's record (loss, forward_kl, tail_kl, seconds per stage, validation_kl at checkpoints,
    and in the last one kept_step and kept_validation_kl: what OUT holds; a fresh run's first record also lists
    the questions drawn before it, for the initialisation and the validation set, their seconds, init_s and
    validation_set_s, and start_validation_kl). on_start(steps done, cache) runs once before the first step."""
    cfg.check()
    out = Path(out)
    tok = inference.tokenizer
    doc = tok(text, add_special_tokens=False).input_ids
    if not doc:
        raise CartridgeError("document text is empty", field="text")
    save = _saver(out, model, cfg)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with ChunkContext(inference, teacher_system(text), "__distill-teacher") as teacher:
        trainer, first = _trainer(inference, teacher, text, doc, out, cfg, model=model, device=device, dtype=dtype)
        done = trainer.resume(cfg.steps)
        val = _validation(inference, teacher, doc, cfg, pad, trainer, first)
        if on_start is not None:
            on_start(done, trainer.cache)
        start = trainer.cache.cartridge()
        save(start)
        sampler = _sampler(inference, out, cfg, model=model, dtype=dtype, server=server)
        try:
            sampler.sync(start)
            run = Run(cfg, inference, doc, teacher, sampler, trainer, pad)
            bar = tqdm(range(done, cfg.steps), desc="distill", unit="step", disable=not progress, initial=done,
                       total=cfg.steps)
            for step in bar:
                rec = run_step(run, step, save, first if step == done == 0 else None)
                bar.set_postfix(loss=f"{rec['loss']:.4f}", kl=f"{rec['forward_kl']:.4f}")
                if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                    if val is not None:
                        t0 = time.perf_counter()
                        rec["validation_kl"] = trainer.validate(val)
                        trainer.keep_if_best(rec["validation_kl"], step + 1)
                        rec["validation_s"] = time.perf_counter() - t0
                    trainer.save()
                bar.write(_line(rec, cfg.steps))
                if on_step is not None:
                    on_step(rec, trainer.cache)
        finally:
            sampler.close()
        if trainer.best is not None:
            _keep_best(trainer, save)
    return trainer.history


def _validation(inference: Any, teacher: ChunkContext, doc: list[int], cfg: DistillConfig, pad: int,
                trainer: Trainer, first: dict) -> Any:
    """The validation batch (None when cfg.validate is 0), the start judged as a candidate; for a fresh run,
    `first` (what the first step's record adds) gets every question drawn before step 1 and the seconds."""
    t0 = time.perf_counter()
    asked, val = validation_rows(inference, teacher, doc, cfg, pad, trainer.student.device)
    if not trainer.history:
        first.update(questions=first.pop("init_questions", []) + asked, validation_set_s=time.perf_counter() - t0)
    if val is not None and trainer.best is None:
        trainer.keep_if_best(trainer.validate(val), len(trainer.history))
        first["start_validation_kl"] = trainer.best["kl"]
    return val


def _keep_best(trainer: Trainer, save: Callable[..., Path]) -> None:
    """OUT ends as the best cartridge validation judged (and the last record says which)."""
    best = trainer.best
    trainer.history[-1].update(kept_step=best["step"], kept_validation_kl=best["kl"])
    # written even when the last step is the best (the same cartridge): its manifest says so as well
    save(trainer.best_cartridge(), kept_step=str(best["step"]), validation_kl=f"{best['kl']:.6f}")


def _trainer(inference: Any, teacher: ChunkContext, text: str, doc: list[int], out: Path, cfg: DistillConfig, *,
             model: str, device: str, dtype: str) -> tuple[Trainer, dict]:
    """The trainer around the start (start/initial.py): the document's first p tokens (`prefix`), or select /
    match from init_questions teacher-answered conversations, skipped when a checkpoint will replace them. Also
    what the start did, for the first step's record (init_questions, init_s; empty when nothing ran)."""
    model_dir = resolve_model_path(model)
    student = Student(model_dir, device, dtype)
    info: dict = {}
    if cfg.init != "prefix" and not checkpoint_path(out).exists():
        t0 = time.perf_counter()
        questions, rows = observe(inference, teacher, doc, cfg)
        kv = select_start(student, model_dir, teacher.doc_ids, rows, cfg.tokens, cfg.frozen_tokens, cfg.init)
        info = {"init_questions": questions, "init_s": time.perf_counter() - t0}
    else:  # prefix; or a resume, where the checkpoint replaces the cache (its shape is the same)
        kv = student.prefill(initial_ids(inference.tokenizer, text, cfg.tokens))
    cache = TrainableKV(*kv, cfg.frozen_tokens)
    trainer = Trainer(student, cache, cfg.lr, checkpoint_path(out),
                      {**cfg.resume_key(), "model": model, "document": digest(doc)}, loss=LOSS,
                      schedule="cosine", steps=cfg.steps)
    return trainer, info


def _line(rec: dict, steps: int) -> str:
    val = f" validation_kl {rec['validation_kl']:.4f}" if "validation_kl" in rec else ""
    cost = " ".join(f"{k[:-2]} {rec[k]:.1f}s" for k in ("question_s", "rollout_s", "teacher_s", "gradient_s",
                                                          "sync_s"))
    return f"step {rec['step']}/{steps} loss {rec['loss']:.4f} kl {rec['forward_kl']:.4f}{val} | {cost}"


def _sampler(inference: Any, out: Path, cfg: DistillConfig, *, model: str, dtype: str, server: str | None) -> Any:
    if cfg.rollout == "engine":
        return StudentSampler(inference, out, "__distill-student")
    # veRL's agent loop, hydra and Ray: imported only for a run that samples through them
    from final.training.onpolicy.verl_rollout import VerlRollout

    return VerlSampler(VerlRollout(model=model, cartridge=out, server=server, max_tokens=cfg.answer_tokens,
                                   temperature=cfg.temperature, dtype=dtype))


def _saver(out: Path, model: str, cfg: DistillConfig) -> Callable[[Any], Path]:
    """Write the cartridge (atomically: save_cartridge renames a finished temp file) and its manifest."""
    def save(cart: Any, **extra: str) -> Path:
        path = save_cartridge(cart, out)
        labels = {"format": "chat", "method": f"on-policy distillation ({LOSS})", "init": cfg.init, **extra}
        CartridgeManifest.describe(cart, path, cartridge_id=out.stem, model_id=model, labels=labels,
                                   positions="after_prefix").write(path)
        return path

    return save
