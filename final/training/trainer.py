"""The optimizer side shared by `train` / `learn` (off-policy) and `distill` (on-policy): Adam on a cartridge's
trainable part, one step per batch, a record per step, and a checkpoint (cache, optimizer, records, settings) that
a resumed run continues from. A checkpoint made with other settings is refused, not silently mixed, and so is a
step budget below the steps it already holds (its cache would be saved under a smaller step count)."""

from __future__ import annotations

import copy
import hashlib
import math
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from final.errors import CartridgeError
from final.training.losses import distill_loss

SCHEDULES = ("constant", "cosine")


def scheduled_lr(lr: float, schedule: str, step: int, steps: int) -> float:
    """The lr of step `step` (0-based) of `steps`: constant, or cosine from lr down to 0 at the budget's end
    (a resumed run with a larger budget stretches the curve, so its lr rises again from where it was)."""
    if schedule == "constant":
        return lr
    return lr * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))


def checkpoint_path(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".ckpt")


def digest(ids: Sequence[int]) -> str:
    """A short fingerprint of token ids (what a checkpoint must match to be resumed)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


class Trainer:
    def __init__(self, student: Any, cache: Any, lr: float, ckpt: Path, key: dict, loss: str = "forward_topk",
                 schedule: str = "constant", steps: int = 1):
        self.student, self.cache, self.ckpt, self.key, self.loss = student, cache, Path(ckpt), key, loss
        self.lr, self.schedule, self.steps = lr, schedule, steps
        cache.to(student.device)
        self.opt = torch.optim.Adam([p for p in cache.parameters() if p.requires_grad], lr=lr)
        self.history: list[dict] = []
        self.best: dict | None = None  # {"step", "kl", "cache": state_dict}: the best cartridge validation judged

    def resume(self, steps: int) -> int:
        """Load the checkpoint if there is one; returns the steps already done."""
        if self.ckpt.is_file():
            self.history = self._load()
        if steps < len(self.history):
            raise CartridgeError(f"the checkpoint already holds {len(self.history)} steps, more than the {steps} "
                                 f"asked for; ask for at least {len(self.history)} or delete {self.ckpt}",
                                 file=str(self.ckpt), field="steps")
        return len(self.history)

    def step(self, batch: Any, **extra: Any) -> dict:
        """One Adam step on a batch (final.training.train.Batch); returns and keeps the step's record: its loss and
        KL (the batch as it came, before the cartridge learned from it), its lr and seconds, and `extra`."""
        t0 = time.perf_counter()
        lr = scheduled_lr(self.lr, self.schedule, len(self.history), self.steps)
        for group in self.opt.param_groups:  # set every step: a resumed optimizer's saved lr is not trusted
            group["lr"] = lr
        out = distill_loss(self.student, self.cache, batch, self.loss)
        if not torch.isfinite(out.loss):
            raise CartridgeError(f"loss is {out.loss.item()} at step {len(self.history) + 1}; lower the lr", field="lr")
        self.opt.zero_grad(set_to_none=True)
        out.loss.backward()
        self.opt.step()
        rec = {"step": len(self.history) + 1, "loss": out.loss.item(), "forward_kl": out.forward_kl,
               "tail_kl": out.tail_kl, "targets": out.targets, "lr": lr,
               **({"keep_kl": out.keep_kl} if out.keep_kl is not None else {}),
               **({"hidden": out.hidden} if out.hidden is not None else {}),
               "gradient_s": time.perf_counter() - t0, **extra}
        self.history.append(rec)
        return rec

    @torch.no_grad()
    def validate(self, batch: Any) -> float:
        """The cartridge's KL (the teacher's top-k plus a bucket for the rest: losses.forward_topk_tail) on a batch
        it is not trained on."""
        return distill_loss(self.student, self.cache, batch, "forward_topk").tail_kl

    def keep_if_best(self, kl: float, step: int) -> bool:
        """Keep a copy of the cartridge as it is after `step` steps if `kl` is the lowest validation KL so far."""
        if self.best is not None and not kl < self.best["kl"]:
            return False
        self.best = {"step": step, "kl": kl,
                     "cache": {k: v.detach().cpu().clone() for k, v in self.cache.state_dict().items()}}
        return True

    def best_cartridge(self) -> Any:
        """The kept cartridge (final.cartridges.format.CartridgeKV)."""
        kept = copy.deepcopy(self.cache).cpu()
        kept.load_state_dict(self.best["cache"])
        return kept.cartridge()

    def save(self) -> None:
        state = {"cache": {k: v.detach().cpu() for k, v in self.cache.state_dict().items()},
                 "optimizer": self.opt.state_dict(), "history": list(self.history), "config": self.key,
                 "best": self.best}
        tmp = self.ckpt.with_name(f".{self.ckpt.name}.tmp")
        torch.save(state, tmp)
        tmp.replace(self.ckpt)

    def _load(self) -> list[dict]:
        path = self.ckpt
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            saved = state["config"]
            if saved != self.key:
                diff = sorted(k for k in set(saved) | set(self.key) if saved.get(k) != self.key.get(k))
                raise CartridgeError(f"checkpoint was made with other settings ({', '.join(diff)}); delete it or "
                                     "use the same settings", file=str(path), field="checkpoint")
            self.cache.load_state_dict(state["cache"])
            self.opt.load_state_dict(state["optimizer"])
            self.best = state.get("best")
            return [dict(r) for r in state["history"]]
        except (RuntimeError, KeyError, TypeError, EOFError, ValueError) as exc:
            if isinstance(exc, CartridgeError):
                raise
            raise CartridgeError(f"unreadable training checkpoint: {type(exc).__name__}: {str(exc)[:200]}",
                                 file=str(path), field="checkpoint") from None
