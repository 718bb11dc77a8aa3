"""Sampling requests, validated once for every backend (core: no engine, no veRL).

Two vocabularies meet here:
- seed 003's `generate(...)` keywords (max_tokens, temperature, n, seed, stop, logprobs, ...), which
  `parse_sampling` turns into a `Sampling`: the SGLang-named params a rollout receives, plus n, logprobs and
  do_sample;
- SGLang 0.5.2's sampling keys, whose value rules (`check_params`) the embedded engine applies to every request
  it gets, from us or from veRL.
Every number must be finite: NaN slips through comparisons (`NaN < 0` is False), so it is refused first.
The per-row seed rule (row i of a call samples with seed + i) lives here too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from final.errors import SamplingError

# seed 003's generate() keywords, plus ours
SAMPLING_KEYS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_new_tokens", "n", "do_sample", "seed", "stop",
    "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "prompt_logprobs", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_new_tokens", "json_schema", "regex", "ebnf", "structural_tag"})
# SGLang's constraint keys (at most one per request), in the order its rule names them; json_schema and
# structural_tag are JSON text (a dict is serialized here), regex a regular expression, ebnf xgrammar's EBNF
CONSTRAINT_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")
GREEDY_KEYS = ("temperature", "top_p", "top_k", "min_p")  # dropped when sampling is off: veRL's greedy settings win
TOP_K_ALL = 1 << 30  # SGLang's top_k for "all tokens"; larger values are refused (they overflow index arithmetic)
MIN_REPETITION_PENALTY = 0.01


@dataclass(frozen=True)
class Limits:
    """Bounds on one call's work, checked before any work, so no request can occupy the engine without bound.
    The config's `limits:` (and `final serve`'s flags) can raise them for big offline batches."""

    max_n: int = 64  # samples per prompt
    max_prompts: int = 4096  # prompts per call
    max_stop: int = 16  # stop strings per call
    max_stop_length: int = 256  # characters per stop string
    max_top_logprobs: int = 20  # alternatives per token (top_logprobs; HTTP logprobs: k), as vLLM's max_logprobs
    max_queued_rows: int = 4096  # rows admitted and not yet finished, over every call in flight (admission)
    max_body_bytes: int = 8 * 2**20  # one HTTP request body (final serve: 413 beyond it)
    deadline_s: float | None = None  # a call's rows are aborted this many seconds after it starts (None: never)
    max_cartridge_bytes: int | None = None  # loaded cartridges; beyond, the least recently used unused ones leave
    cartridge_fetch_s: float | None = 120.0  # a load waits this long for a remote source (None: no bound)
    max_grammar_bytes: int = 64 * 2**10  # one constraint's text (json_schema, regex, ebnf or structural_tag)


@dataclass(frozen=True)
class Sampling:
    """A validated sampling request: `params` go to generate_sequences(data, **params) (SGLang keys)."""

    params: dict[str, Any]
    max_new_tokens: int
    n: int = 1
    do_sample: bool = True
    logprobs: bool = False  # the chosen tokens' logprobs
    stop: tuple[str, ...] = field(default=())
    top_logprobs: int = 0  # the k most likely tokens at each generated (and, with prompt_logprobs, prompt) position
    prompt_logprobs: bool = False  # log p(token | tokens before it) for every prompt token (scoring, echo)

    @property
    def seed(self) -> int | None:
        """The call's seed (row i samples with seed + i), or None."""
        return self.params.get("seed")


def row_seed(seed: int | None, row: int) -> int | None:
    """The seed of row `row` of a call: seed + row, so repeated rows (n > 1) differ and every row is reproducible
    whatever else is in the batch or on which replica it runs."""
    return None if seed is None else seed + row


def parse_sampling(sampling: dict[str, Any], *, response_length: int, limits: Limits = Limits()) -> Sampling:
    """generate()'s keywords -> Sampling. Raises SamplingError naming the field; does no work."""
    unknown = set(sampling) - SAMPLING_KEYS
    if unknown:
        raise SamplingError(f"unknown sampling argument; valid: {', '.join(sorted(SAMPLING_KEYS))}",
                            sorted(unknown)[0])
    s = {k: v for k, v in sampling.items() if v is not None or k == "seed"}
    if "max_tokens" in s and "max_new_tokens" in s:
        raise SamplingError("give max_tokens or max_new_tokens, not both", "max_tokens")
    n = s.pop("n", 1)
    logprobs, prompt_logprobs = s.pop("logprobs", False), s.pop("prompt_logprobs", False)
    do_sample = s.pop("do_sample", True)
    for key, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs), ("do_sample", do_sample)):
        if not isinstance(value, bool):
            raise SamplingError(f"must be true or false, got {_short(value)}", key)
    top = check_top_logprobs(s.pop("top_logprobs", 0), limits)
    max_tokens = _max_tokens(s.pop("max_tokens", s.pop("max_new_tokens", response_length)), response_length,
                             prompt_logprobs)
    check_params({**s, "n": n, "max_new_tokens": max_tokens})
    check_limits(n, s.get("stop"), limits)
    s.update(constraint_texts(s, limits))
    if s.get("temperature", 1.0) == 0:
        do_sample = False
    if not do_sample:
        for key in GREEDY_KEYS:
            s.pop(key, None)
    stop = s.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if stop is not None:
        s["stop"] = list(stops)
    # top-k alternatives come with the chosen tokens' own logprobs (vLLM's logprobs=k)
    return Sampling({**s, "max_new_tokens": max_tokens}, max_tokens, n, do_sample, logprobs or top > 0, stops, top,
                    prompt_logprobs)


def _max_tokens(value: Any, response_length: int, prompt_logprobs: bool) -> int:
    """0 generates nothing: only a scoring call (prompt_logprobs) has a use for that."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (value == 0 and not prompt_logprobs):
        raise SamplingError(f"must be a positive integer (0 only with prompt_logprobs=True), got {_short(value)}",
                            "max_tokens")
    if value > response_length:
        raise SamplingError(f"{_short(value)} exceeds rollout.response_length={response_length}", "max_tokens")
    return value


def check_top_logprobs(value: Any, limits: Limits) -> int:
    """`top_logprobs` checked: an integer from 0 to limits.max_top_logprobs (SamplingError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SamplingError(f"must be an integer >= 0, got {_short(value)}", "top_logprobs")
    if value > limits.max_top_logprobs:
        raise SamplingError(f"{_short(value)} exceeds limits.max_top_logprobs={limits.max_top_logprobs}",
                            "top_logprobs")
    return value


def check_limits(n: int, stop: Any, limits: Limits) -> None:
    """`n` and the stop strings checked against the limits (SamplingError naming the field)."""
    if n > limits.max_n:
        raise SamplingError(f"{n} samples per prompt exceed limits.max_n={limits.max_n}", "n")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > limits.max_stop:
        raise SamplingError(f"{len(stops)} stop strings exceed limits.max_stop={limits.max_stop}", "stop")
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_length:
        raise SamplingError(f"a stop string of {longest} characters exceeds limits.max_stop_length="
                            f"{limits.max_stop_length}", "stop")


def constraint_texts(params: dict[str, Any], limits: Limits | None = None) -> dict[str, str]:
    """The constraint key set in params (checked by check_params) as text: a dict JSON-serialized, as SGLang takes
    it. SamplingError naming the key when the text exceeds limits.max_grammar_bytes (no size bound without limits:
    the embedded engine's compile is bounded by its own work limits, final/engine/grammar.py)."""
    out = {}
    for key in CONSTRAINT_KEYS:
        value = params.get(key)
        if value is None:
            continue
        text = value if isinstance(value, str) else json.dumps(value)
        size = len(text.encode("utf-8", "surrogatepass"))
        if limits is not None and size > limits.max_grammar_bytes:
            raise SamplingError(f"{size} bytes exceed limits.max_grammar_bytes={limits.max_grammar_bytes}", key)
        out[key] = text
    return out


def check_constraint(params: dict[str, Any]) -> None:
    """SGLang's rule (at most one of the constraint keys; SamplingError naming the second) and their types:
    json_schema and structural_tag JSON text or an object, regex and ebnf text. min_new_tokens and ignore_eos
    cannot be honoured once a grammar has finished (only a stop token is then allowed), so they are refused with
    one."""
    given = [key for key in CONSTRAINT_KEYS if params.get(key) is not None]
    if len(given) > 1:
        raise SamplingError(f"only one of {', '.join(CONSTRAINT_KEYS)} may be set (got {given[0]} too)", given[1])
    if not given:
        return
    key, value = given[0], params[given[0]]
    kinds = (str, dict) if key in ("json_schema", "structural_tag") else (str,)
    if not isinstance(value, kinds) or not value:
        raise SamplingError(f"must be {'a JSON string or an object' if dict in kinds else 'a string'} and not "
                            f"empty, got {_short(value)}", key)
    if params.get("min_new_tokens"):
        raise SamplingError(f"cannot be honoured with {key}: the grammar decides where the output ends",
                            "min_new_tokens")
    if params.get("ignore_eos"):
        raise SamplingError(f"cannot be honoured with {key}: once the grammar is complete only a stop token "
                            "is allowed", "ignore_eos")


# ---- SGLang's value rules ---------------------------------------------------------------------------------
def _number(params: dict, name: str, integer: bool = False) -> Any:
    value = params[name]
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise SamplingError(f"must be {'an integer' if integer else 'a number'}, got {_short(value)}", name)
    if not integer and not math.isfinite(value):
        raise SamplingError(f"must be a finite number, got {value!r}", name)
    return value


def _in_range(params: dict, name: str, low: float, high: float, *, low_open: bool = False, integer: bool = False,
              text: str | None = None) -> None:
    if name not in params:
        return
    value = _number(params, name, integer)
    if value < low or (low_open and value == low) or value > high:
        raise SamplingError(f"must be {text or f'in [{low}, {high}]'}, got {_short(value)}", name)


def check_params(params: dict[str, Any]) -> None:
    """Value rules of SGLang's sampling keys that are present (absent keys take SGLang's defaults)."""
    big = 2**31 - 1
    _in_range(params, "max_new_tokens", 0, big, integer=True, text=">= 0")
    _in_range(params, "min_new_tokens", 0, params.get("max_new_tokens", big), integer=True,
              text=f"in [0, max_new_tokens={params.get('max_new_tokens', 'unset')}]")
    _in_range(params, "temperature", 0.0, 1e6, text="in [0, 1e6]")
    _in_range(params, "top_p", 0.0, 1.0, low_open=True, text="in (0, 1]")
    if "top_k" in params and (_number(params, "top_k", True) == 0 or not -1 <= params["top_k"] <= TOP_K_ALL):
        raise SamplingError(f"must be -1 (off) or in [1, {TOP_K_ALL}], got {params['top_k']}", "top_k")
    _in_range(params, "min_p", 0.0, 1.0)
    _in_range(params, "n", 1, big, integer=True, text=f"in [1, {big}]")
    _in_range(params, "presence_penalty", -2.0, 2.0)
    _in_range(params, "frequency_penalty", -2.0, 2.0)
    # SGLang takes (0, 2]; below 0.01 the division overflows float32 logits to inf (then NaN probabilities)
    _in_range(params, "repetition_penalty", MIN_REPETITION_PENALTY, 2.0, text=f"in [{MIN_REPETITION_PENALTY}, 2]")
    seed = params.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**63):
        raise SamplingError(f"must be a 64-bit integer, got {_short(seed)}", "seed")
    stop = params.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop)):
        raise SamplingError(f"must be a string or a list of non-empty strings, got {_short(stop)}", "stop")
    if isinstance(stop, str) and not stop:
        raise SamplingError("must not be empty", "stop")
    ids = params.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, (list, tuple, set)) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < big for i in ids)):
        raise SamplingError(f"must be a list of token ids, got {_short(ids)}", "stop_token_ids")
    if "ignore_eos" in params and not isinstance(params["ignore_eos"], bool):
        raise SamplingError(f"must be true or false, got {_short(params['ignore_eos'])}", "ignore_eos")
    check_constraint(params)


def _short(value: Any, limit: int = 120) -> str:
    """A value for an error message, cut so a huge request cannot make a huge message."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4300-digit str() limit
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
