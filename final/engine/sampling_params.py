"""Sampling parameters in SGLang 0.5.2's vocabulary, validated on construction.

The embedded engine accepts the same `sampling_params` dicts veRL sends to SGLang. Keys SGLang knows but we
cannot honour (grammars, logit bias, custom processors) are refused when set, never silently ignored; keys
SGLang does not know are refused as SGLang would refuse them. `seed` is our addition (per-request RNG).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from final.errors import SamplingError

GREEDY_EPS = 1e-6  # SGLang's _SAMPLING_EPS: temperature below this means greedy

# SGLang 0.5.2 SamplingParams.__init__ arguments that only shape text output; we return token ids.
_TEXT_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}
# SGLang 0.5.2 arguments the embedded engine does not implement: refused unless left at None.
_UNSUPPORTED = {"json_schema", "regex", "ebnf", "structural_tag", "custom_params", "logit_bias"}


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

    def __post_init__(self) -> None:
        def num(name: str, kinds=(int, float)) -> Any:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise SamplingError(f"must be a number, got {value!r}", name)
            return value

        if num("max_new_tokens", int) < 0:
            raise SamplingError(f"must be >= 0, got {self.max_new_tokens}", "max_new_tokens")
        if num("min_new_tokens", int) < 0 or self.min_new_tokens > self.max_new_tokens:
            raise SamplingError(f"must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}",
                                "min_new_tokens")
        if num("temperature") < 0:
            raise SamplingError(f"must be >= 0, got {self.temperature}", "temperature")
        if not 0.0 < num("top_p") <= 1.0:
            raise SamplingError(f"must be in (0, 1], got {self.top_p}", "top_p")
        if num("top_k", int) == 0 or self.top_k < -1:
            raise SamplingError(f"must be -1 (off) or >= 1, got {self.top_k}", "top_k")
        if not 0.0 <= num("min_p") <= 1.0:
            raise SamplingError(f"must be in [0, 1], got {self.min_p}", "min_p")
        if num("n", int) < 1:
            raise SamplingError(f"must be >= 1, got {self.n}", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= num(name) <= 2.0:
                raise SamplingError(f"must be in [-2, 2], got {getattr(self, name)}", name)
        if not 0.0 < num("repetition_penalty") <= 2.0:
            raise SamplingError(f"must be in (0, 2], got {self.repetition_penalty}", "repetition_penalty")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise SamplingError(f"must be an integer, got {self.seed!r}", "seed")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingError(f"must be a string or a list of non-empty strings, got {self.stop!r}", "stop")
        self.stop = list(self.stop)
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple, set)) or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise SamplingError(f"must be a list of token ids, got {ids!r}", "stop_token_ids")
        self.stop_token_ids = sorted(set(ids))

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
