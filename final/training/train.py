"""Context distillation into a cartridge (the cartridges repo's `train.py` with `loss_type="logits"`).

The student is the frozen model plus a trainable KV prefix of p tokens (final/training/student.py); it reads a row
*without* the document and is trained, on every target token of the rows (final/training/rows.py), to match the
teacher's top-k distribution (losses.py; the KL to the teacher is reported beside the loss). Adam updates the
prefix only (trainer.py); the first `frozen_tokens` stay fixed (the attention sink). Beside the KL: the teacher's
hidden states at the same tokens (hidden.py, cfg.hidden), and steps served beside a partner cartridge whose own
answers are kept (compose.py, cfg.beside and cfg.keep).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from final.cartridges.format import save_cartridge
from final.cartridges.manifest import CartridgeManifest, sha256_file
from final.errors import CartridgeError
from final.models import resolve_model_path
from final.prompts import document_ids
from final.training.compose import keep_pick, keep_rows
from final.training.hidden import HiddenTeacher, KeptStates
from final.training.losses import Targets
from final.training.rows import Conversation, read_conversations
from final.training.settings import TrainConfig
from final.training.start.initial import initial_kv
from final.training.student import Student, TrainableKV
from final.training.trainer import Trainer, checkpoint_path, digest


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T] each row's token stream after the cartridge, right-padded
    where: torch.Tensor  # [B, T] the positions that predict a target token (row-major order = the targets' order)
    targets: Targets
    # a frozen partner cartridge served with the trained one for this batch: (keys, values, in_front)
    beside: tuple[list[torch.Tensor], list[torch.Tensor], bool] | None = None
    # rows about that partner, served the same way, whose answers must stay the partner's alone: (rows, weight)
    keep: tuple["Batch", float] | None = None
    # the teacher's hidden states at `where`, per layer, and the weight of matching them (hidden.py)
    hidden: tuple[list[torch.Tensor], float] | None = None


@dataclass
class Partner:
    """A frozen cartridge a step may serve beside the trained one, and the rows about it (compose.keep_rows)."""
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    rows: Sequence[Conversation] = ()


def make_batch(convs: Sequence[Conversation], pad_id: int, device: torch.device) -> Batch:
    """Rows -> tensors: position j predicts token j+1, so target token j is read at position j-1; masked targets
    are left out."""
    width = max(len(c.ids) for c in convs)
    ids = torch.full((len(convs), width), pad_id, dtype=torch.long)
    where = torch.zeros((len(convs), width), dtype=torch.bool)
    k = min(len(t) for c in convs for t in c.top_ids)
    top_ids, top_lps = [], []
    for r, c in enumerate(convs):
        row, start = c.ids, c.first_target
        ids[r, :len(row)] = torch.tensor(row)
        keep = [j for j in range(len(row) - start) if c.mask is None or c.mask[j]]
        where[r, [start - 1 + j for j in keep]] = True
        top_ids += [c.top_ids[j][:k] for j in keep]
        top_lps += [c.top_logprobs[j][:k] for j in keep]
    targets = Targets(torch.tensor(top_ids, dtype=torch.long, device=device),
                      torch.tensor(top_lps, dtype=torch.float32, device=device))
    return Batch(ids.to(device), where.to(device), targets)


def batch_order(n: int, batch: int, step: int, seed: int) -> list[int]:
    """Row indices of a step's batch: epochs of seeded permutations, so a resumed run sees the same batches."""
    out: list[int] = []
    start = step * batch
    epoch, offset = divmod(start, n)
    while len(out) < batch:
        perm = list(range(n))
        random.Random(f"{seed}/{epoch}").shuffle(perm)
        out += perm[offset:offset + batch - len(out)]
        epoch, offset = epoch + 1, 0
    return out


def partner_for(step: int, cfg: TrainConfig, partners: Sequence[Any]) -> tuple[Any, bool] | None:
    """The partner (and whether it goes in front) of step `step`, or None: seeded by step, so a resumed run trains
    beside the same partners."""
    rng = random.Random(f"{cfg.seed}/beside/{step}")
    if not partners or rng.random() >= cfg.beside:
        return None
    return rng.choice(partners), rng.random() < 0.5


def train(student: Student, cache: TrainableKV, convs: Sequence[Conversation], cfg: TrainConfig, pad_id: int,
          ckpt: Path, progress: bool = True, log: Callable[[str], None] | None = None,
          identity: dict | None = None, partners: Sequence[Partner] = (), teacher: Any = None) -> list[dict]:
    """Adam on the cache's trainable part for cfg.steps steps, resuming from `ckpt` when it exists and saving to it
    every cfg.checkpoint_every steps and at the end; returns every step's record (loss, forward_kl; resumed ones
    included). `identity` (data and start fingerprints) must match the checkpoint's, as cfg's settings must.
    `partners`: frozen cartridges, one served beside the trained one on cfg.beside of the steps, its rows' answers
    kept at weight cfg.keep. `teacher` (hidden.KeptStates): the rows' teacher, whose hidden states they match at
    weight cfg.hidden."""
    if cfg.hidden and teacher is None:
        raise CartridgeError("matching hidden states needs the document's teacher (final.training.hidden)",
                             field="hidden")
    key = {**{k: v for k, v in asdict(cfg).items() if k not in ("steps", "checkpoint_every")}, **(identity or {})}
    trainer = Trainer(student, cache, cfg.lr, ckpt, key)
    done = trainer.resume(cfg.steps)
    bar = tqdm(range(done, cfg.steps), desc="train", unit="step", disable=not progress, initial=done,
               total=cfg.steps)
    for step in bar:
        rows = [convs[i] for i in batch_order(len(convs), cfg.batch, step, cfg.seed)]
        batch = make_batch(rows, pad_id, student.device)
        if cfg.hidden:
            batch.hidden = (teacher.states(batch.ids, batch.where), cfg.hidden)
        partner = partner_for(step, cfg, partners)
        if partner is not None:
            _beside(batch, *partner, step, cfg, pad_id, student.device)
        rec = trainer.step(batch, beside=partner and ("front" if partner[1] else "behind"))
        bar.set_postfix(loss=f"{rec['loss']:.4f}", kl=f"{rec['forward_kl']:.4f}")
        (log or bar.write)(f"step {step + 1}/{cfg.steps} loss {rec['loss']:.4f} kl {rec['forward_kl']:.4f}")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            trainer.save()
    return trainer.history


def _beside(batch: Batch, partner: Partner, front: bool, step: int, cfg: TrainConfig, pad_id: int,
            device: torch.device) -> None:
    """Serve the step's batch beside `partner`, with half a batch of rows about it to keep (cfg.keep)."""
    batch.beside = (partner.keys, partner.values, front)
    if cfg.keep and partner.rows:
        # read after the same two caches as the batch (distill_loss serves both with the batch's)
        kept = make_batch(keep_pick(partner.rows, step, max(1, cfg.batch // 2), cfg.seed), pad_id, device)
        batch.keep = (kept, cfg.keep)


def train_cartridge(model: str, data: str | Path, out: str | Path, cfg: TrainConfig, *, text: str | None = None,
                    device: str = "cpu", dtype: str = "auto", source_document: str | None = None,
                    progress: bool = True, partners: Sequence[str] = (), init: str = "prefix") -> dict:
    """Rows (learn's fact rows, traces' tool-use rows, your own) -> a trained cartridge at `out` (+ manifest);
    resumes from `out`.ckpt. The KV starts (start/initial.py) as the first P tokens of `text` (the document), else
    of the first row's own stream (a tool-use cartridge has no document: it starts as the prompt it is trained
    under); `init` select / match cut it from the whole document's KV by the rows' attention. `partners`: texts
    whose first P tokens, as cartridges, are served beside this one on cfg.beside of the steps."""
    cfg.check()
    if cfg.beside and not partners:
        raise CartridgeError("training beside partners needs partner texts", field="beside")
    path = resolve_model_path(model)
    tok = AutoTokenizer.from_pretrained(path)
    student = Student(path, device, dtype)
    convs = read_conversations(data, student.vocab_size)
    kv, init_kind, fingerprint = initial_kv(student, path, tok, convs, cfg, text, init,
                                            resumed=checkpoint_path(out).exists())
    cache = TrainableKV(*kv, cfg.frozen_tokens)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    identity = {"model": model, "data_sha256": sha256_file(data), "init": fingerprint}
    beside = [document_ids(tok, t)[:cfg.tokens] for t in partners] if cfg.beside else []
    if beside:
        identity["partners"] = [digest(ids) for ids in beside]
    kvs = [student.prefill(ids) for ids in beside]
    rows = [keep_rows(student, tok, t, kv, cfg.tokens, seed=cfg.seed) if cfg.keep else ()
            for t, kv in zip(partners, kvs)]
    teacher = _hidden_teacher(student, tok, text, cfg)
    losses = train(student, cache, convs, cfg, pad, checkpoint_path(out), progress=progress, identity=identity,
                   partners=[Partner(*kv, r) for kv, r in zip(kvs, rows)], teacher=teacher)
    cart = cache.cartridge(student.dtype)
    out = save_cartridge(cart, out)
    used = {k: str(getattr(cfg, k)) for k in ("beside", "keep", "hidden") if getattr(cfg, k)}
    labels = {"format": "chat", "method": "distillation" if text is None else "fact-row distillation",
              "init": init_kind, "steps": str(cfg.steps), **used, "conversations": str(len(convs)), "data": str(data)}
    manifest = CartridgeManifest.describe(cart, out, cartridge_id=out.stem, model_id=model,
                                          source_document=source_document, labels=labels,
                                          positions="after_prefix")  # the training forward's convention (Student)
    manifest.write(out)
    return {"out": str(out), "tokens": cart.num_tokens, "steps": cfg.steps, "conversations": len(convs),
            "first_loss": losses[0]["loss"], "last_loss": losses[-1]["loss"], "first_kl": losses[0]["forward_kl"],
            "last_kl": losses[-1]["forward_kl"], "bytes": cart.nbytes}


def _hidden_teacher(student: Student, tok: Any, text: str | None, cfg: TrainConfig) -> KeptStates | None:
    """The rows' teacher whose hidden states they match (cfg.hidden > 0): the whole document, each row's states
    computed once and kept; else None."""
    if not cfg.hidden:
        return None
    if text is None:
        raise CartridgeError("matching the teacher's hidden states needs the document: give --text", field="hidden")
    return KeptStates(HiddenTeacher(student, document_ids(tok, text)))
