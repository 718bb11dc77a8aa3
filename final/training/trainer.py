"""The optimizer side shared by `train` (off-policy) and `distill` (on-policy): Adam on a cartridge's trainable
part, one step per batch, a record per step, and a checkpoint (cache, optimizer, records, settings) that a
resumed run continues from. A checkpoint made with other settings is refused, not silently mixed, and so is a
step budget below the steps it already holds (its cache would be saved under a smaller step count)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from final.training.losses import distill_loss
from final.errors import CartridgeError


SCHEDULES = ("constant", "cosine")


def scheduled_lr(lr: float, schedule: str, step: int, steps: int) -> float:
    """The lr of step `step` (0-based) of `steps`: constant, or cosine from lr down to 0 at the budget's end
    (a resumed run with a larger budget stretches the curve, so its lr rises again from where it was)."""
    if schedule == "constant":
        return lr
    return lr * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))


class Trainer:
    def __init__(self, student: Any, cache: Any, lr: float, ckpt: Path, key: dict, loss: str = "forward_topk",
                 schedule: str = "constant", steps: int = 1, hard: float = 0.0, key_lr: float = 1.0):
        self.student, self.cache, self.ckpt, self.key, self.loss = student, cache, Path(ckpt), key, loss
        self.hard = hard  # losses.step_loss: the weight of the rows' own tokens' cross-entropy
        self.lr, self.schedule, self.steps = lr, schedule, steps
        cache.to(student.device)
        self.opt = torch.optim.Adam(_groups(cache, key_lr), lr=lr)
        self.history: list[dict] = []
        self.best: dict | None = None  # {"step", "kl", "cache": state_dict}: the best cartridge validation judged
        # the running sum of the trainable part after each step past "from" (average_from / accumulate); the steps
        # in it are len(history) - from, as the sum is saved with the history it belongs to
        self.average: dict | None = None  # {"from", "sum": state_dict (float64) or None}

    def resume(self, steps: int) -> int:
        """Load the checkpoint if there is one; returns the steps already done."""
        if self.ckpt.is_file():
            self.history = self._load()
        if steps < len(self.history):
            raise CartridgeError(f"the checkpoint already holds {len(self.history)} steps, more than the {steps} "
                                 f"asked for; ask for at least {len(self.history)} or delete {self.ckpt}",
                                 file=str(self.ckpt), field="steps")
        return len(self.history)

    def step(self, batch: Any, updates: int = 1, **extra: Any) -> dict:
        """`updates` Adam steps on one batch (final.training.train.Batch); returns and keeps the step's record. Its
        loss and KL are the first update's: the batch as it came, before the cartridge learned from it."""
        t0 = time.perf_counter()
        first = None
        lr = scheduled_lr(self.lr, self.schedule, len(self.history), self.steps)
        for group in self.opt.param_groups:  # set every step: a resumed optimizer's saved lr is not trusted
            group["lr"] = lr * group.get("scale", 1.0)
        for _ in range(updates):
            out = distill_loss(self.student, self.cache, batch, self.loss, self.hard)
            if not torch.isfinite(out.loss):
                raise CartridgeError(f"loss is {out.loss.item()} at step {len(self.history) + 1}; lower --lr",
                                     field="lr")
            self.opt.zero_grad(set_to_none=True)
            out.loss.backward()
            self.opt.step()
            if first is None:
                first = out
        rec = {"step": len(self.history) + 1, "loss": first.loss.item(), "forward_kl": first.forward_kl,
               "tail_kl": first.tail_kl,
               "reverse_kl": first.reverse_kl, "targets": first.targets, "lr": lr,
               **({"keep_kl": first.keep_kl} if first.keep_kl is not None else {}),
               **({"quiet": first.quiet} if first.quiet is not None else {}),
               **({"hidden": first.hidden} if first.hidden is not None else {}),
               "gradient_s": time.perf_counter() - t0,
               **extra}
        self.history.append(rec)
        return rec

    def average_from(self, first: int) -> None:
        """Average the cartridge over the steps after step `first` (0-based count of steps done before the window):
        a resumed checkpoint whose window started elsewhere (another --steps) cannot give that average."""
        saved = self.average
        if saved is not None and saved["sum"] is not None and saved["from"] != first:
            raise CartridgeError(f"the checkpoint averages the cartridge from step {saved['from'] + 1}; these steps "
                                 f"and --average start it at step {first + 1}: use the same --steps or delete "
                                 f"{self.ckpt}", file=str(self.ckpt), field="average")
        if saved is None or saved["from"] != first:
            self.average = {"from": first, "sum": None}

    @torch.no_grad()
    def accumulate(self) -> None:
        """Add the trainable part as it is now to the running average, if the window has begun."""
        if self.average is None or len(self.history) <= self.average["from"]:
            return
        now = {k: v.detach().to("cpu", torch.float64, copy=True) for k, v in self.cache.state_dict().items()
               if k.startswith("trainable")}  # a copy: the sum is added to in place
        if self.average["sum"] is None:
            self.average["sum"] = now
        else:
            for k, v in now.items():
                self.average["sum"][k].add_(v)

    @torch.no_grad()
    def use_average(self) -> None:
        """Put the average (the mean of what accumulate() saw) in the cache: the cartridge the run writes. The
        checkpoint keeps the last step's, which a resumed run continues from."""
        avg = self.average
        if avg is None or avg["sum"] is None:
            raise CartridgeError("no step was averaged: --average needs at least one step in its window",
                                 field="average")
        count = len(self.history) - avg["from"]
        state = self.cache.state_dict()
        self.cache.load_state_dict({**state, **{k: (v / count).to(state[k].dtype) for k, v in avg["sum"].items()}})

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
        import copy

        kept = copy.deepcopy(self.cache).cpu()
        kept.load_state_dict(self.best["cache"])
        return kept.cartridge()

    def save(self) -> None:
        state = {"cache": {k: v.detach().cpu() for k, v in self.cache.state_dict().items()},
                 "optimizer": self.opt.state_dict(), "history": list(self.history), "config": self.key,
                 "best": self.best, "average": self.average}
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
            self.average = state.get("average")
            return [dict(r) for r in state["history"]]
        except (RuntimeError, KeyError, TypeError, EOFError, ValueError) as exc:
            if isinstance(exc, CartridgeError):
                raise
            raise CartridgeError(f"unreadable training checkpoint: {type(exc).__name__}: {str(exc)[:200]}",
                                 file=str(path), field="checkpoint") from None


def _groups(cache: Any, key_lr: float) -> list[dict]:
    """Adam's parameter groups for a TrainableKV: the trainable keys at `key_lr` times the lr (0: not trained, so the
    start's keys - the document's own under `match` - stay what the model's queries already read), the values at the
    lr. At the default one group, as before the share existed: an optimizer's saved state holds its groups, so
    checkpoints made then still resume."""
    if key_lr == 1.0:
        return [{"params": [p for p in cache.parameters() if p.requires_grad]}]
    cache.trainable_keys.requires_grad_(key_lr > 0)  # no gradient is worked out for what is not trained
    keys = [{"params": list(cache.trainable_keys), "scale": key_lr}] if key_lr else []
    return [{"params": list(cache.trainable_values)}] + keys


def checkpoint_cartridge(path: Path) -> tuple[Any, int]:
    """The cartridge a training checkpoint (OUT.ckpt) holds - as it stood after the run's last step, which the
    written file is not under --average (the mean) or validation (the best step), nor before a stopped run ends -
    and that step. In the training forward's convention (after_prefix), checked as a cartridge file is."""
    from final.cartridges.format import PARTS, assemble, read_pt

    name = str(path)
    state = read_pt(path)  # the existence and emptiness checks a cartridge file gets
    cache, history = state.get("cache"), state.get("history")
    if not isinstance(cache, dict) or not isinstance(history, list):
        raise CartridgeError(f"not a training checkpoint (OUT.ckpt of learn, train or distill): it holds "
                             f"{sorted(state)}, not a cache and a history", file=name, field="checkpoint")
    layers: dict[tuple[str, int], Any] = {}
    for key, tensor in cache.items():  # TrainableKV's state_dict: "trainable_keys.3", ...
        part, _, index = key.rpartition(".")
        if part not in PARTS or not index.isdigit():
            raise CartridgeError(f"the checkpoint's cache holds {key!r}, not a cartridge's part", file=name,
                                 field="checkpoint")
        layers[part, int(index)] = tensor
    parts = {p: [layers[q, i] for q, i in sorted(layers) if q == p] for p in PARTS}
    return assemble(parts, name), len(history)
