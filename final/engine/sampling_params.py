"""Sampling parameters in SGLang 0.5.2's vocabulary, validated on construction.

The embedded engine accepts the same `sampling_params` dicts veRL sends to SGLang, constraints included
(json_schema, regex, ebnf, structural_tag: final/engine/grammar.py). Keys SGLang knows but we cannot honour (logit
bias, custom processors) are refused when set, never silently ignored; keys SGLang does not know are refused as
SGLang would refuse them. `seed` is our addition (per-request RNG).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from final.errors import SamplingError
from final.sampling import CONSTRAINT_KEYS, check_params, constraint_texts

GREEDY_EPS = 1e-6  # SGLang's _SAMPLING_EPS: temperature below this means greedy

# SGLang 0.5.2 SamplingParams.__init__ arguments that only shape text output; we return token ids.
_TEXT_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}
# SGLang 0.5.2 arguments the embedded engine does not implement: refused unless left at None.
_UNSUPPORTED = {"custom_params", "logit_bias"}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: str | None = None  # JSON text (an object is serialized)
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # JSON text (an object is serialized)

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        check_params(values)  # final.sampling: one set of rules
        for key, text in constraint_texts(values).items():
            setattr(self, key, text)
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        self.stop_token_ids = sorted(set(self.stop_token_ids))

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(key, text) of the request's constraint, or None."""
        return next(((key, getattr(self, key)) for key in CONSTRAINT_KEYS if getattr(self, key) is not None), None)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

    @classmethod
    def from_dict(cls, params: dict | None) -> "SamplingParams":
        if params is None:
            return cls()
        if not isinstance(params, dict):
            raise SamplingError(f"sampling_params must be a dict, got {type(params).__name__}")
        known = {f.name for f in fields(cls)}
        kwargs = {}
        for key, value in params.items():
            if key in known:
                if value is not None or key == "seed":
                    kwargs[key] = value
            elif key in _TEXT_ONLY:
                continue
            elif key in _UNSUPPORTED:
                if value is not None:
                    raise SamplingError("is not supported by the embedded engine", key)
            else:
                raise SamplingError(f"unknown sampling parameter (SGLang 0.5.2 has no {key!r})", key)
        return cls(**kwargs)
