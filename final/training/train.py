"""Context distillation into a cartridge (the cartridges repo's `train.py` with `loss_type="logits"`).

The student is the frozen model plus a trainable KV prefix of p tokens (post-RoPE keys/values per layer,
[1, H_kv, p, D]); it reads a conversation *without* the document and is trained, on every target token of the rows
(final.training.rows: every token after the system turn, as the repo, or the answer's only), to match the
teacher's top-k distribution (final.training.losses; the KL to the teacher is reported beside the loss). Adam
updates the prefix only; the first `frozen_tokens` stay fixed (the attention sink). The student - the frozen
model, the trainable prefix, their positions and dtypes - is final.training.student.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from final.training.rows import Conversation
from final.training.losses import Targets
from final.training.quiet import MEASURES
from final.training.student import Student, TrainableKV
from final.training.trainer import Trainer
from final.errors import CartridgeError


@dataclass
class TrainConfig:
    tokens: int  # p: the cartridge's length
    steps: int = 100  # optimizer steps
    batch: int = 4  # conversations per step
    lr: float = 2e-2
    frozen_tokens: int = 1
    seed: int = 0
    checkpoint_every: int = 10
    # the share of steps trained beside a partner cartridge (in front of it or after it, as `cartridge=[a, b]`
    # serves two): a cartridge only ever trained alone loses 30-40% of its accuracy composed (bench/RESULTS.md)
    beside: float = 0.0
    # the weight of keeping the partner's answers at those steps (final/distill/keep.py): 0 trains our rows only
    keep: float = 0.0
    # the weight of our KV's loudness to the partner's rows at those steps (final/distill/quiet.py): 0 not measured
    quiet: float = 0.0
    # what that term measures (quiet.MEASURES): the loudness, the attention mass, or the loudness over our own rows'
    # (a ratio no uniform shrinking of our values lowers)
    quiet_by: str = "loudness"
    # the weight of the cross-entropy of each row's own tokens beside the KL to the teacher (losses.step_loss)
    hard: float = 0.0
    # the share of each step's rows answered by the cartridge being trained, scored by the teacher then
    # (final/distill/live.py: on-policy rows; train() needs a `live` source for them)
    on_policy: float = 0.0
    # the trainable keys' lr as a share of lr (0: the start's keys kept, only the values trained)
    key_lr: float = 1.0
    # the weight of matching the teacher's hidden states at every layer on the rows' targets (final/distill/hidden.py)
    hidden: float = 0.0
    # the share of the last steps whose cartridges are averaged into the one written (0: the last step's): Adam at a
    # constant lr ends wherever its walk stopped; the mean over the window (Polyak / SWA) is the flatter point
    average: float = 0.0

    def check(self) -> None:
        check_training(self, ("tokens", "steps", "batch", "checkpoint_every"))
        for key in ("beside", "on_policy", "average"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise CartridgeError(f"must be in [0, 1], got {getattr(self, key)}", field=key)
        for key in ("keep", "quiet", "hard", "key_lr", "hidden"):
            if not (0.0 <= getattr(self, key) and math.isfinite(getattr(self, key))):
                raise CartridgeError(f"must be a number >= 0, got {getattr(self, key)}", field=key)
        for key, what in (("keep", "keeping a partner's answers"), ("quiet", "quiet beside a partner")):
            if getattr(self, key) and not self.beside:
                raise CartridgeError(f"{what} needs steps beside a partner (beside > 0)", field=key)
        if self.quiet_by not in MEASURES:
            raise CartridgeError(f"must be one of {', '.join(MEASURES)}, got {self.quiet_by!r}", field="quiet_by")


def check_training(cfg: object, counts: Sequence[str]) -> None:
    """The settings every cartridge training shares (train and distill): counts >= 1, the frozen part inside the
    cache, a positive finite lr."""
    for key in counts:
        if getattr(cfg, key) < 1:
            raise CartridgeError(f"must be at least 1, got {getattr(cfg, key)}", field=key)
    if not 0 <= cfg.frozen_tokens < cfg.tokens:
        raise CartridgeError(f"must be in [0, tokens={cfg.tokens}), got {cfg.frozen_tokens}", field="frozen_tokens")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise CartridgeError(f"must be a positive number, got {cfg.lr}", field="lr")


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T] each row's token stream after the cartridge, right-padded
    where: torch.Tensor  # [B, T] the positions that predict a target token (row-major order = the targets' order)
    targets: Targets
    # a frozen partner cartridge served with the trained one for this batch: (keys, values, in_front)
    beside: tuple[list[torch.Tensor], list[torch.Tensor], bool] | None = None
    # rows about that partner, served the same way, whose answers must stay the partner's alone: (rows, weight)
    keep: tuple["Batch", float] | None = None
    # the weight of our KV's loudness to those rows (final/distill/quiet.py); 0: not measured
    quiet: float = 0.0
    quiet_by: str = "loudness"  # what it measures (TrainConfig.quiet_by)
    # the teacher's hidden states at `where`, per layer, and the weight of matching them (final/distill/hidden.py)
    hidden: tuple[list[torch.Tensor], float] | None = None


@dataclass
class Partner:
    """A frozen cartridge a step may serve beside the trained one, and the rows about it (keep.keep_rows)."""
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
    top_ids, top_lps, tokens, token_lps, sampled = [], [], [], [], []
    for r, c in enumerate(convs):
        row, start = c.ids, c.first_target
        ids[r, :len(row)] = torch.tensor(row)
        keep = [j for j in range(len(row) - start) if c.mask is None or c.mask[j]]
        where[r, [start - 1 + j for j in keep]] = True
        top_ids += [c.top_ids[j][:k] for j in keep]
        top_lps += [c.top_logprobs[j][:k] for j in keep]
        tokens += [row[start + j] for j in keep]
        token_lps += [c.token_logprobs[j] if c.token_logprobs else 0.0 for j in keep]
        sampled += [c.sampled and start + j >= len(c.prompt_ids) for j in keep]
    t = Targets(*(torch.tensor(x, dtype=d, device=device) for x, d in (
        (top_ids, torch.long), (top_lps, torch.float32), (tokens, torch.long), (token_lps, torch.float32),
        (sampled, torch.bool))))
    return Batch(ids.to(device), where.to(device), t)


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


def checkpoint_path(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".ckpt")


def train(student: Student, cache: TrainableKV, convs: Sequence[Conversation], cfg: TrainConfig, pad_id: int,
          ckpt: Path, progress: bool = True, log: Callable[[str], None] | None = None,
          identity: dict | None = None, partners: Sequence[Any] = (), live: Any = None,
          teacher: Any = None) -> list[dict]:
    """Adam on the cache's trainable part for cfg.steps steps, resuming from `ckpt` when it exists and saving to it
    every cfg.checkpoint_every steps and at the end; returns every step's record (loss, forward_kl; resumed ones
    included). `identity` (data and init fingerprints) must match the checkpoint's, as cfg's settings must.
    `partners`: frozen cartridges (Partner), one served beside the trained one on cfg.beside of the steps, its
    rows' answers kept at weight cfg.keep. `live` (final.training.live.LiveFacts): the source of the cfg.on_policy
    share of each step's rows, answered by the cache as it is at that step. `teacher` (final.training.hidden.
    HiddenTeacher or WindowTeacher): the rows' teacher, whose hidden states they match at weight cfg.hidden."""
    from tqdm import tqdm

    fresh = _live_rows(cfg)
    if fresh and live is None:
        raise CartridgeError("on-policy rows need a source of them (final.training.live)", field="on_policy")
    if cfg.hidden and teacher is None:
        raise CartridgeError("matching hidden states needs the document's teacher (final.training.hidden)",
                             field="hidden")
    key = {**_resume_key(cfg), **(identity or {}), **({"live": live.key()} if fresh else {})}
    trainer = Trainer(student, cache, cfg.lr, ckpt, key, hard=cfg.hard, key_lr=cfg.key_lr)
    done = trainer.resume(cfg.steps)
    if cfg.average:
        trainer.average_from(average_start(cfg))
    bar = tqdm(range(done, cfg.steps), desc="train", unit="step", disable=not progress, initial=done,
               total=cfg.steps)
    for step in bar:
        rows = [convs[i] for i in batch_order(len(convs), cfg.batch - fresh, step, cfg.seed)]
        info: dict = {}
        if fresh:
            sampled, info = live.rows(step, fresh, cache)
            rows += sampled
        batch = make_batch(rows, pad_id, student.device)
        if cfg.hidden:
            batch.hidden = (teacher.states(batch.ids, batch.where, rows), cfg.hidden)
        partner = partner_for(step, cfg, partners)
        if partner is not None:
            _beside(batch, *partner, step, cfg, pad_id, student.device)
        rec = trainer.step(batch, beside=partner and ("front" if partner[1] else "behind"), **info)
        trainer.accumulate()
        bar.set_postfix(loss=f"{rec['loss']:.4f}", kl=f"{rec['forward_kl']:.4f}")
        (log or bar.write)(f"step {step + 1}/{cfg.steps} loss {rec['loss']:.4f} kl {rec['forward_kl']:.4f}")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            trainer.save()
    if cfg.average:
        trainer.use_average()
    return trainer.history


def average_start(cfg: TrainConfig) -> int:
    """The steps done before the averaged window (cfg.average of the steps, at least the last one)."""
    return cfg.steps - max(1, round(cfg.steps * cfg.average))


def _live_rows(cfg: TrainConfig) -> int:
    """How many of a step's rows are on-policy: at least one when asked for at all."""
    return max(1, round(cfg.batch * cfg.on_policy)) if cfg.on_policy else 0


def _beside(batch: Batch, partner: Partner, front: bool, step: int, cfg: TrainConfig, pad_id: int,
            device: torch.device) -> None:
    """Serve the step's batch beside `partner`, with half a batch of rows about it to keep (cfg.keep) and to be
    quiet to (cfg.quiet)."""
    from final.training.keep import keep_pick

    batch.beside = (partner.keys, partner.values, front)
    if (cfg.keep or cfg.quiet) and partner.rows:
        # read after the same two caches as the batch (distill_loss serves both with the batch's)
        kept = make_batch(keep_pick(partner.rows, step, max(1, cfg.batch // 2), cfg.seed), pad_id, device)
        batch.keep, batch.quiet, batch.quiet_by = (kept, cfg.keep), cfg.quiet, cfg.quiet_by


def _setting_labels(cfg: TrainConfig) -> dict:
    """The manifest's labels of the settings a run used away from their default (what the file was trained with)."""
    used = {k: str(getattr(cfg, k)) for k in ("beside", "keep", "quiet", "on_policy", "hidden", "average")
            if getattr(cfg, k)}
    if cfg.quiet and cfg.quiet_by != "loudness":
        used["quiet_by"] = cfg.quiet_by
    return used


def _hidden_teacher(student: Student, tok: Any, text: str | None, cfg: TrainConfig,
                    windows: int | None = None, tiled: bool = False) -> Any:
    """The rows' teacher whose hidden states they match (cfg.hidden > 0), else None: the whole document, or each
    row's `windows`-token window of it (the rows were scored by those: `learn --teacher-tokens`)."""
    if not cfg.hidden:
        return None
    if text is None:
        raise CartridgeError("matching the teacher's hidden states needs the document: give --text", field="hidden")
    from final.training.hidden import HiddenTeacher, KeptStates, WindowTeacher
    from final.prompts import document_ids

    if windows:
        return KeptStates(WindowTeacher(student, tok, text, windows, tiled))
    return KeptStates(HiddenTeacher(student, document_ids(tok, text)))


def digest(ids: Sequence[int]) -> str:
    """A short fingerprint of token ids (what a checkpoint must match to be resumed)."""
    import hashlib

    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


# settings TrainConfig gained after checkpoints were first written, and the default each behaves as before at
_ADDED_LATER = {"beside": 0.0, "keep": 0.0, "quiet": 0.0, "quiet_by": "loudness", "hard": 0.0, "on_policy": 0.0,
                "key_lr": 1.0, "hidden": 0.0, "average": 0.0}


def _resume_key(cfg: TrainConfig) -> dict:
    """What must match for a resume to continue the same run (the step budget may grow; a setting added later is
    left out at its default, so checkpoints from before it existed still resume)."""
    return {k: v for k, v in asdict(cfg).items()
            if k not in ("steps", "checkpoint_every") and not (k in _ADDED_LATER and v == _ADDED_LATER[k])}


def initial_ids(tokenizer, text: str, tokens: int, what: str = "text") -> list[int]:
    """The first `tokens` ids of the text rendered as a cartridge's document (a system turn): the `prefix` init,
    and the first-p-tokens baseline (a cartridge built from the whole text, cut at p, is the same KV)."""
    from final.prompts import document_ids

    ids = document_ids(tokenizer, text)
    if len(ids) < tokens:
        raise CartridgeError(f"renders to {len(ids)} tokens, fewer than the {tokens} the cartridge needs",
                             field=what)
    return ids[:tokens]


def _init_ids(tok, convs: Sequence[Conversation], tokens: int, text: str | None,
              init_text: str | None) -> tuple[list[int], str]:
    """The KV's initial tokens and what they are (the manifest's `init` label)."""
    if init_text is not None:
        return initial_ids(tok, init_text, tokens, "init_text"), "text"
    if text is not None:
        return initial_ids(tok, text, tokens, "text"), "prefix"
    ids = convs[0].ids
    if len(ids) < tokens:
        raise CartridgeError(f"the first conversation has {len(ids)} tokens, fewer than the {tokens} the cartridge "
                             "needs: give --text or --init-text", field="tokens")
    return ids[:tokens], "data"


def train_cartridge(model: str, data: str | Path, out: str | Path, cfg: TrainConfig, *, text: str | None = None,
                    init_text: str | None = None, device: str = "cpu", dtype: str = "auto",
                    save_dtype: torch.dtype | None = None, cartridge_id: str | None = None,
                    source_document: str | None = None, progress: bool = True, partners: Sequence[str] = (),
                    live: Any = None, init: str = "prefix", chunk_tokens: int | None = None,
                    teacher_tokens: int | None = None, teacher_tiles: bool = False) -> dict:
    """Conversations (synth's or traces') -> a trained cartridge at `out` (+ manifest); resumes from `out`.ckpt.
    The KV starts as the first P tokens of `init_text`, else of `text` (the document), else of the first
    conversation's own stream (a tool-use cartridge has no document: it starts as the prompt it is trained under).
    `partners`: texts whose first P tokens, as cartridges, are served beside this one on cfg.beside of the steps.
    `live`: the source of on-policy rows (final.training.live.LiveFacts), when cfg.on_policy > 0.
    `init` select / match: the KV starts as the document's own, cut from its `chunk_tokens`-token chunks by the
    attention of the rows about each (final.training.start.chunks; `text` needed), computed unless a checkpoint will
    replace it. `teacher_tokens`: the rows were scored by windows of `text` this long (`learn --teacher-tokens`),
    so their hidden states (cfg.hidden) are matched to each row's window's (`teacher_tiles`: its tile's)."""
    from transformers import AutoTokenizer

    from final.training.start.chunks import start
    from final.training.rows import read_conversations
    from final.training.keep import keep_rows
    from final.cartridges.format import save_cartridge
    from final.cartridges.manifest import CartridgeManifest, sha256_file
    from final.models import resolve_model_path
    from final.prompts import document_ids

    cfg.check()
    if cfg.beside and not partners:
        raise CartridgeError("training beside partners needs partner texts", field="beside")
    path = resolve_model_path(model)
    tok = AutoTokenizer.from_pretrained(path)
    student = Student(path, device, dtype)
    convs = read_conversations(data, student.vocab_size)
    first = _init_ids(tok, convs, cfg.tokens, text, init_text)
    kv, init_kind, fingerprint = start(student, path, tok, convs, cfg, first, text, init, chunk_tokens,
                                       checkpoint_path(out).exists())
    cache = TrainableKV(*kv, cfg.frozen_tokens)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    identity = {"model": model, "data_sha256": sha256_file(data), "init": fingerprint}
    beside = [document_ids(tok, t)[:cfg.tokens] for t in partners] if cfg.beside else []
    if beside:
        identity["partners"] = [digest(ids) for ids in beside]
    kvs = [student.prefill(ids) for ids in beside]
    rows = [keep_rows(student, tok, t, kv, cfg.tokens, seed=cfg.seed) if cfg.keep or cfg.quiet else ()
            for t, kv in zip(partners, kvs)]
    teacher = _hidden_teacher(student, tok, text, cfg, teacher_tokens, teacher_tiles)
    losses = train(student, cache, convs, cfg, pad, checkpoint_path(out), progress=progress, identity=identity,
                   partners=[Partner(*kv, r) for kv, r in zip(kvs, rows)], live=live, teacher=teacher)
    cart = cache.cartridge(save_dtype or student.dtype)
    out = save_cartridge(cart, out)
    labels = {"format": "chat", "method": "distillation" if text is None else "self-study distillation",
              "init": init_kind, "steps": str(cfg.steps), **_setting_labels(cfg),
              "conversations": str(len(convs)), "data": str(data)}
    manifest = CartridgeManifest.describe(cart, out, cartridge_id=cartridge_id or out.stem, model_id=model,
                                          source_document=source_document, labels=labels,
                                          positions="after_prefix")  # the training forward's convention (Student)
    manifest.write(out)
    return {"out": str(out), "tokens": cart.num_tokens, "steps": cfg.steps, "conversations": len(convs),
            "first_loss": losses[0]["loss"], "last_loss": losses[-1]["loss"], "first_kl": losses[0]["forward_kl"],
            "last_kl": losses[-1]["forward_kl"], "bytes": cart.nbytes}
