"""One call's request, prepared once for every entry point (generate(), agenerate(), `final serve`).

`prepare` validates everything a call can get wrong before any work — prompts, sampling, per-prompt cartridges
and tools_kwargs, limits, what the backend can serve — and tokenizes. `Request.dataproto` is the veRL input:
each prompt repeated n times (prompt-major, as veRL's trainer repeats rows), with the flags that ask the
backend for each row's engine record (final.outputs.ROW_INFO) and, for tool calls, their trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from final.errors import CartridgeError, ConfigError, PromptError, SamplingError
from final.outputs import ROW_INFO, TRACE_KEY
from final.prompts import Prompt, build_dataproto, normalize_prompts, tokenize
from final.sampling import Limits, Sampling, parse_sampling


@dataclass
class Request:
    prompts: list[Prompt]
    ids: list[list[int]]  # token ids per prompt
    sampling: Sampling
    cartridges: list[tuple[Any, ...]] | None = None  # per prompt: ids or specs, composed in order
    tools_kwargs: list[dict] | None = None  # per prompt (multi-turn)
    show_progress: bool = False

    @property
    def n(self) -> int:
        return self.sampling.n

    @property
    def rows(self) -> int:
        return len(self.ids) * self.sampling.n

    def cartridge_refs(self) -> list[Any]:
        """Every cartridge the request names (ids and specs), for loading and holding them while it runs."""
        return [c for row in self.cartridges or [] for c in row]

    def dataproto(self, pad_token_id: int, eos_token_ids: list[int], cartridge_ids: list[tuple[str, ...]] | None):
        """The veRL DataProto of this request: rows prompt-major (prompt i's samples are rows i*n .. i*n+n-1)."""
        n = self.sampling.n
        rep = (lambda values: [v for v in values for _ in range(n)])  # noqa: E731
        non_tensor: dict[str, list] = {}
        if cartridge_ids is not None:
            non_tensor["cartridges"] = rep(cartridge_ids)
        if self.tools_kwargs is not None:
            non_tensor["tools_kwargs"] = rep(self.tools_kwargs)
        meta = {"do_sample": self.sampling.do_sample, ROW_INFO: True, TRACE_KEY: self.tools_kwargs is not None}
        eos = sorted(set(eos_token_ids) | set(self.sampling.params.get("stop_token_ids") or []))
        return build_dataproto(rep(self.ids), rep(self.prompts), pad_token_id, eos, meta_info=meta,
                               non_tensor=non_tensor)


def prepare(prompts: Any, *, tokenizer: Any, prompt_length: int, response_length: int, limits: Limits,
            sampling: dict[str, Any], raw: bool = False, cartridge: Any = None, tools_kwargs: Any = None,
            tool_names: list[str] | None = None) -> Request:
    """Validate and tokenize one call. `tool_names` is None unless the backend runs multi-turn tool calling, and
    then lists the tools a prompt is offered by default."""
    parsed = parse_sampling(sampling, response_length=response_length, limits=limits)
    items = normalize_prompts(prompts, raw=raw)
    if len(items) > limits.max_prompts:
        raise PromptError(f"{len(items)} prompts exceed limits.max_prompts={limits.max_prompts}")
    if len(items) * parsed.n > limits.max_prompts * limits.max_n:
        raise SamplingError(f"{len(items)} prompts x n={parsed.n} rows exceed the limits", "n")
    carts = cartridges_per_prompt(cartridge, len(items))
    ids = tokenize(items, tokenizer, prompt_length, after_cartridge=[bool(c) for c in carts] if carts else None)
    kwargs = None
    if tool_names is not None:
        if any(p.messages is None for p in items):
            raise PromptError("multi-turn tool calling needs chat prompts (strings or message lists), not raw text "
                              "or token ids")
        # each row offers the tools named in its tools_kwargs (veRL); default: every tool, no kwargs
        kwargs = per_prompt({name: {} for name in tool_names} if tools_kwargs is None else tools_kwargs, len(items))
        if parsed.logprobs:
            raise SamplingError("per-token logprobs are for single-turn calls; a multi-turn call returns veRL's "
                                "rollout_log_probs in its DataProto (rollout.calculate_log_probs)", "logprobs")
    elif tools_kwargs is not None:
        raise ConfigError("tools_kwargs needs tool calling: set rollout.multi_turn.enable: true and tool_config_path",
                          key="rollout.multi_turn.enable")
    return Request(items, ids, parsed, carts, kwargs)


def cartridges_per_prompt(cartridge: Any, n_prompts: int) -> list[tuple[Any, ...]] | None:
    """"id" | ["a", "b"] (composed, for every prompt) | one entry per prompt (an id, a list, or None). Ids may
    also be Tokasaurus specs ({id, source, force_redownload}) that are loaded on demand."""
    if cartridge is None:
        return None
    one = (str, Mapping)
    if isinstance(cartridge, one):
        return [(cartridge,)] * n_prompts
    if not isinstance(cartridge, (list, tuple)):
        raise CartridgeError(f"must be an id, a list of ids or one entry per prompt, got {cartridge!r}",
                             field="cartridge")
    if all(isinstance(c, one) for c in cartridge):
        return [tuple(cartridge)] * n_prompts
    if len(cartridge) != n_prompts:
        raise CartridgeError(f"has {len(cartridge)} entries for {n_prompts} prompts", field="cartridge")
    rows = [() if c is None else (c,) if isinstance(c, one) else c for c in cartridge]
    for i, row in enumerate(rows):
        if not isinstance(row, (list, tuple)) or not all(isinstance(c, one) for c in row):
            raise CartridgeError(f"entry {i} must be an id, a list of ids or None, got {row!r}", field="cartridge")
    return [tuple(row) for row in rows]


def per_prompt(value: Any, n: int) -> list[dict]:
    """tools_kwargs: one dict for every prompt, or a list with one dict per prompt."""
    if isinstance(value, dict):
        return [value] * n
    if isinstance(value, list) and len(value) == n and all(isinstance(v, dict) for v in value):
        return value
    raise SamplingError(f"must be a dict (same for every prompt) or a list with one dict per prompt ({n})",
                        "tools_kwargs")
