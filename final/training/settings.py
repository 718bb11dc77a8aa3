"""The settings of every cartridge training, as plain dataclasses checked by `check()` (nano-vllm's config.py
style): what a fact row is made of (FactConfig), what the trainer does with the rows (TrainConfig), how the
on-policy loop asks and samples (SynthConfig, DistillConfig), and the `learn` recipe's defaults (LearnSettings).
A command's flags set the few a user needs; the rest come from a `--settings FILE` (YAML whose keys are these
fields), read by read_settings. Nothing here imports torch, so `final cartridge --help` stays light."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from final.errors import CartridgeError, ConfigError

INITS = ("prefix", "select", "match")  # the KV's start (final/training/start): first P tokens, or the document's own
MIN_WINDOW = 16  # the fewest tokens of a teacher's window


def check_counts(cfg: object, keys: Sequence[str], least: int = 1) -> None:
    for key in keys:
        if getattr(cfg, key) < least:
            raise CartridgeError(f"must be at least {least}, got {getattr(cfg, key)}", field=key)


def check_share(cfg: object, keys: Sequence[str]) -> None:
    for key in keys:
        if not 0.0 <= getattr(cfg, key) <= 1.0:
            raise CartridgeError(f"must be in [0, 1], got {getattr(cfg, key)}", field=key)


def check_weight(cfg: object, keys: Sequence[str]) -> None:
    for key in keys:
        if not (getattr(cfg, key) >= 0.0 and math.isfinite(getattr(cfg, key))):
            raise CartridgeError(f"must be a number >= 0, got {getattr(cfg, key)}", field=key)


def check_choice(cfg: object, key: str, allowed: Sequence[str]) -> None:
    if getattr(cfg, key) not in allowed:
        raise CartridgeError(f"must be one of {list(allowed)}, got {getattr(cfg, key)!r}", field=key)


def check_training(cfg: object, counts: Sequence[str]) -> None:
    """What every cartridge training shares: counts >= 1, the frozen part inside the cache, a positive finite lr."""
    check_counts(cfg, counts)
    if not 0 <= cfg.frozen_tokens < cfg.tokens:
        raise CartridgeError(f"must be in [0, tokens={cfg.tokens}), got {cfg.frozen_tokens}", field="frozen_tokens")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise CartridgeError(f"must be a positive number, got {cfg.lr}", field="lr")


@dataclass
class FactConfig:
    """The fact rows a document becomes (final/training/document/facts.py): per sentence, quote and cloze rows."""
    quote_sentences: int = 2  # sentences in a quote row's answer
    cues: int = 3  # quote rows per sentence (one per cue, at most)
    teacher_tokens: int | None = None  # None: the whole document is the teacher's system turn; else its window
    top_k: int = 20  # the teacher's logprobs kept per target token
    seed: int = 0

    def check(self) -> None:
        check_counts(self, ("quote_sentences", "cues", "top_k"))
        if self.teacher_tokens is not None and self.teacher_tokens < MIN_WINDOW:
            raise CartridgeError(f"must be at least {MIN_WINDOW}, got {self.teacher_tokens}", field="teacher_tokens")


@dataclass
class TrainConfig:
    """The off-policy trainer (final/training/train.py) over rows: Adam on the cartridge, a constant lr."""
    tokens: int  # p: the cartridge's length
    steps: int = 100  # optimizer steps
    batch: int = 4  # rows per step
    lr: float = 2e-2  # the cartridges repo's
    frozen_tokens: int = 1  # the attention sink
    seed: int = 0
    checkpoint_every: int = 10
    # the share of steps trained beside a partner cartridge, in front of it or after it, as `cartridge=[a, b]` serves
    # two (final/training/compose.py): a cartridge trained alone loses answers composed (RESULTS, "Composition")
    beside: float = 0.0
    keep: float = 0.0  # at those steps, the weight of keeping the partner's own answers (compose.keep_rows)
    hidden: float = 0.0  # the weight of matching the teacher's hidden states at the rows' targets (hidden.py)

    def check(self) -> None:
        check_training(self, ("tokens", "steps", "batch", "checkpoint_every"))
        check_share(self, ("beside",))
        check_weight(self, ("keep", "hidden"))
        if self.keep and not self.beside:
            raise CartridgeError("keeping a partner's answers needs steps beside a partner (beside > 0)", field="keep")


@dataclass
class LearnSettings:
    """`learn`'s recipe beyond its flags: the keys of `learn --settings FILE`, defaults as measured (RESULTS,
    "Does a cartridge know its document?")."""
    batch: int = 8
    lr: float = 2e-2
    beside: float = 0.5  # half the steps beside a partner (RESULTS, "Composition")
    keep_partner: float | None = None  # None: 1 beside partners, else 0
    hidden: float | None = None  # None: 4, or 0 where rows are taught from windows (--teacher-tokens)
    top_k: int = 20

    def check(self) -> None:
        check_counts(self, ("batch", "top_k"))
        check_share(self, ("beside",))
        check_weight(self, [k for k in ("keep_partner", "hidden") if getattr(self, k) is not None])
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise CartridgeError(f"must be a positive number, got {self.lr}", field="lr")


SEED_TYPES = ("structuring", "summarization", "question", "use_case", "creative")


@dataclass
class SynthConfig:
    """How the on-policy loop's questions are written (final/training/onpolicy/selfstudy.py: the cartridges repo's
    self-study prompts): a chunk of the document per step, in the repo's system-prompt template."""
    min_chunk_tokens: int = 512  # the repo draws each chunk's length in [512, 4096]
    max_chunk_tokens: int = 2048
    question_tokens: int = 64
    question_temperature: float = 0.6
    cot_probability: float = 0.2  # the repo's prob_cot_a
    seed_types: tuple[str, ...] = SEED_TYPES

    def check(self) -> None:
        check_counts(self, ("min_chunk_tokens", "max_chunk_tokens", "question_tokens"))
        if self.min_chunk_tokens > self.max_chunk_tokens:
            raise CartridgeError(f"min {self.min_chunk_tokens} is above max {self.max_chunk_tokens}",
                                 field="chunk_tokens")
        check_share(self, ("cot_probability",))
        unknown = sorted(set(self.seed_types) - set(SEED_TYPES))
        if unknown or not self.seed_types:
            raise CartridgeError(f"unknown seed types {unknown}; choose from {list(SEED_TYPES)}", field="seed_types")


ROLLOUTS = ("engine", "verl")


@dataclass
class DistillConfig:
    """The on-policy loop (final/training/onpolicy/loop.py): the student samples, final is the teacher."""
    tokens: int  # p: the cartridge's length
    steps: int = 40
    questions: int = 8  # questions per step
    n: int = 1  # student samples per question
    temperature: float = 1.0  # the student's sampling temperature
    answer_tokens: int = 128
    top_k: int = 20
    lr: float = 2e-3  # on a cosine decay over the steps (RESULTS, "On-policy distillation")
    init: str = "match"
    init_questions: int = 16  # select / match: teacher-answered conversations whose attention picks the KV
    validate: int = 12  # teacher-answered conversations judging the cartridge at each checkpoint; OUT is the best
    frozen_tokens: int = 1
    seed: int = 0
    checkpoint_every: int = 5
    rollout: str = "engine"
    synth: SynthConfig = field(default_factory=SynthConfig)

    def check(self) -> None:
        check_training(self, ("tokens", "steps", "questions", "n", "answer_tokens", "top_k", "checkpoint_every",
                              "init_questions"))
        check_counts(self, ("validate",), least=0)
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise CartridgeError(f"must be a positive number, got {self.temperature}", field="temperature")
        check_choice(self, "rollout", ROLLOUTS)
        check_choice(self, "init", INITS)
        self.synth.check()

    def resume_key(self) -> dict:
        """What must match for a resume to continue the same run (the step budget may grow)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("steps", "checkpoint_every", "rollout")}


def read_settings(path: Path, cls: type, **fixed: Any) -> Any:
    """`cls` (a dataclass above) from the YAML mapping in `path` (its keys: cls's fields, nested dataclasses as
    mappings; the fields in `fixed` are the command's flags and may not be set there), then checked. A key that
    is unknown or of the wrong type is a ConfigError naming the file and the key."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) if path is not None else {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"unreadable settings file: {exc}", path=str(path)) from None
    out = cls(**fixed, **_fields(cls, data or {}, str(path), "", set(fixed)))
    out.check()
    return out


def _fields(cls: type, data: Any, path: str, prefix: str, taken: set[str]) -> dict:
    if not isinstance(data, dict):
        raise ConfigError(f"must be a mapping of settings, got {type(data).__name__}", key=prefix.rstrip(".") or None,
                          path=path)
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)} - taken
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(f"unknown setting; choose from {sorted(known)}" + (
                " (set by a flag)" if key in taken else ""), key=name, path=path)
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            out[key] = kind(**_fields(kind, value, path, f"{name}.", set()))
        else:
            out[key] = _typed(value, kind, name, path)
    return out


def _typed(value: Any, kind: Any, key: str, path: str) -> Any:
    """`value` as the field's type allows (an int is a float too; a list is a tuple), else a ConfigError."""
    options = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    if value is None and type(None) in options:
        return None
    for option in options:
        base = typing.get_origin(option) or option
        if base is tuple and isinstance(value, list):
            return tuple(value)
        if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if base in (int, str) and type(value) is base:
            return value
    names = " or ".join(getattr(o, "__name__", str(o)) for o in options)
    raise ConfigError(f"must be {names}, got {value!r}", key=key, path=path)
