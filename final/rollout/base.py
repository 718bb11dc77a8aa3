"""The backend interface: everything InferenceEngine (and through it chat, the server, evals and bench) may ask
of a rollout backend. Nothing above final/rollout/ reaches into a backend any other way.

A Backend is veRL's BaseRollout (generate_sequences: DataProto in, the DataProto veRL 0.6.0's SGLangRollout
returns out) plus:
- `capabilities`: what it can serve, so a request it cannot is refused before any work (`Capabilities.check`);
- an awaitable `agenerate_sequences` and a token stream `astream` (whole rows at the end where the backend
  cannot stream), both with a per-call `Observer` for progress and tool events;
- `tool_schemas()`, the `cartridge_target` a CartridgeService drives (None: no local cartridge store),
  `pad_token_id`, `preflight` (checks that need no model), and `shutdown`;
- veRL's weight sync: `update_weights(named tensors)` checks the whole update against the model's parameters
  before writing any (final.weights), then writes it and drops what the old weights made (prefix caches); LoRA
  tensors (veRL's `peft_config`, `base_sync_done`) are merged into the weights (final.adapters.merge);
- LoRA adapters served per request where `capabilities.adapters` (`load_adapter`, per-row names in
  `non_tensor_batch["adapters"]`);
  `release()` / `resume(tags)` free and bring back rebuildable memory.
When a call's meta_info sets final.outputs.ROW_INFO, the output carries each row's engine record; with
PROMPT_LOGPROBS / TOP_LOGPROBS that record has every prompt token's logprob and the k best alternatives per position
(scoring: such a call takes the batch path, one engine request per row, even where multi-turn is on).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, AsyncIterator, ClassVar, Protocol

from verl.workers.rollout.base import BaseRollout

from final.config import multi_turn_option
from final.errors import ToolConfigError, UnsupportedError
from final.outputs import Completion, completions_of
from final.sampling import CONSTRAINT_KEYS, Sampling

# SGLang sampling keys every backend honours; a backend lists the others it supports in Capabilities.
BASIC_KEYS = frozenset({"max_new_tokens", "temperature", "top_p", "n", "seed", "stop", "ignore_eos",
                        "presence_penalty", "frequency_penalty"})
ALL_KEYS = BASIC_KEYS | {"top_k", "min_p", "repetition_penalty", "min_new_tokens", "stop_token_ids"}
# each key's value that changes nothing (veRL sends them): passes where the key itself is refused
NO_OP = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0, "stop_token_ids": [],
         "presence_penalty": 0.0, "frequency_penalty": 0.0}
# what a backend that decodes under a grammar serves: every key, the constraints (json_schema, regex, ebnf,
# structural_tag) included
CONSTRAINED_KEYS = ALL_KEYS | frozenset(CONSTRAINT_KEYS)


def constraint_notes(why: str) -> tuple[tuple[str, str], ...]:
    """Capabilities.notes for a backend that cannot constrain decoding: why, and what would serve it."""
    return tuple((key, why) for key in CONSTRAINT_KEYS)


def check_constrained_calls(backend: str, capabilities: "Capabilities", config: Any) -> None:
    """Refuse rollout.multi_turn.constrain_tool_calls at start where the backend cannot decode under a grammar."""
    mt = config.multi_turn
    if not (mt.enable and multi_turn_option(mt, "constrain_tool_calls")) or \
            "structural_tag" in capabilities.sampling_keys:
        return
    note = dict(capabilities.notes).get("structural_tag")
    raise ToolConfigError(f"needs constrained decoding (structural_tag), which the {backend} backend cannot serve"
                          + (f": {note}" if note else ""), key="rollout.multi_turn.constrain_tool_calls")


@dataclass(frozen=True)
class Capabilities:
    seed: bool = True  # generate(seed=...): reproducible rows
    stop_strings: bool = True
    logprobs: bool = True  # the chosen tokens' logprobs
    prompt_logprobs: bool = True  # logprobs of given tokens (scoring, echo; multi-turn's calculate_log_probs pass)
    top_logprobs: bool = True  # the k most likely tokens at each position
    cartridges: bool = False
    tools: bool = False  # multi-turn tool calling
    call_tools: bool = False  # a call's own tools run in final's multi-turn loop (generate(tools=..., max_turns=...))
    tool_events: bool = False  # Observer.tool_event as calls happen
    streaming: bool = False  # astream yields every token (else each row once, complete)
    weight_updates: bool = True  # update_weights (checked whole first: final.weights), release/resume
    weights_by_path: bool = False  # update_weights_from_disk: the weights are read where the engine runs (a server)
    adapters: bool = False  # LoRA adapters served per request (load_adapter, generate(adapter=...))
    sampling_keys: frozenset[str] = ALL_KEYS
    notes: tuple[tuple[str, str], ...] = ()  # (field, what to do instead) for the refusals

    def check(self, backend: str, sampling: Sampling, *, cartridges: bool = False, tools: bool = False,
              adapters: bool = False, call_tools: bool = False) -> None:
        """Refuse, naming the backend and the field, what this backend cannot serve."""
        wanted = [("seed", sampling.seed is not None, self.seed), ("stop", bool(sampling.stop), self.stop_strings),
                  ("adapter", adapters, self.adapters),
                  ("prompt_logprobs", sampling.prompt_logprobs, self.prompt_logprobs),
                  ("top_logprobs", sampling.top_logprobs > 0, self.top_logprobs),
                  ("logprobs", sampling.logprobs, self.logprobs), ("cartridge", cartridges, self.cartridges),
                  ("tools_kwargs", tools, self.tools), ("max_turns", call_tools, self.call_tools)]
        notes = dict(self.notes)
        refused = [field for field, asked, served in wanted if asked and not served]
        refused += [key for key, value in sampling.params.items()
                    if key not in self.sampling_keys and NO_OP.get(key, object()) != value]
        if refused:
            field = refused[0]
            hint = f"; {notes[field]}" if field in notes else ""
            raise UnsupportedError(backend, field, f"not supported by the {backend} backend{hint}")


class Observer(Protocol):
    """Per-call callbacks; a backend calls them from its own thread, so they must be quick and thread-safe."""

    def row_done(self) -> None:
        """A row finished (progress)."""

    def tool_event(self, event: dict) -> None:
        """Multi-turn: an assistant turn, tool call, tool result or finished row ({"type": ..., ...})."""


class CartridgeTarget(Protocol):
    """What final.cartridges.CartridgeService drives: a place that holds cartridge KV for requests."""

    def load_cartridge(self, cartridge_id: str, keys: list, values: list) -> Any: ...

    def unload_cartridge(self, cartridge_id: str) -> bool: ...

    def cartridge_ids(self) -> list[str]: ...


class Backend(BaseRollout, abc.ABC):
    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    pad_token_id: int

    @classmethod
    def preflight(cls, engine_config: Any) -> None:
        """Checks run on the caller's thread before the model is resolved (requirements, signal handlers)."""

    @abc.abstractmethod
    def generate_sequences(self, prompts: Any, *, observer: Observer | None = None, **kwargs: Any) -> Any:
        """veRL's generate_sequences; blocks the calling thread (which must not be running an event loop)."""

    @abc.abstractmethod
    async def agenerate_sequences(self, prompts: Any, *, observer: Observer | None = None, **kwargs: Any) -> Any:
        """generate_sequences, awaitable from any event loop."""

    async def astream(self, prompts: Any, **kwargs: Any) -> AsyncIterator[Completion]:
        """Row updates (cumulative output ids) as they come; each row's last has its finish_reason. This default
        yields every row once, complete, after the whole call (prompts.meta_info must set ROW_INFO)."""
        for row in completions_of(await self.agenerate_sequences(prompts, **kwargs)):
            yield row

    def tool_schemas(self) -> list[dict]:
        """The OpenAI schemas of the tools a multi-turn call offers by default (tools.yaml's)."""
        return []

    @property
    def cartridge_target(self) -> CartridgeTarget | None:
        """Where loaded cartridges live, for CartridgeService; None when cartridges are not held here."""
        return None

    def cartridge_ids(self) -> list[str] | None:
        """Ids a request may name when there is no cartridge_target (e.g. configured remote specs); else None."""
        return None

    def load_adapter(self, name: str, path: str) -> int:
        """Serve the PEFT adapter folder at path to requests naming it (capabilities.adapters); returns its bytes."""
        raise UnsupportedError(self.name, "adapter", dict(self.capabilities.notes).get(
            "adapter", f"the {self.name} backend serves no adapters per request"))

    def unload_adapter(self, name: str) -> bool:
        """Forget an adapter load_adapter served; False when none had that name."""
        return False

    def adapter_names(self) -> list[str]:
        """The adapters requests may name."""
        return []

    async def update_weights_from_disk(self, path: str, keep_cartridges: bool = False) -> None:
        """Load new weights from an HF folder or .safetensors file where the engine runs (capabilities
        .weights_by_path); other backends get the tensors read here, through update_weights."""
        raise UnsupportedError(self.name, "update_weights", "this backend takes the tensors, not a path")

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the backend's engine, threads and processes. Idempotent."""
