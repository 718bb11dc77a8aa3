"""One call's request, prepared once for every entry point (generate(), agenerate(), `final serve`).

`prepare` validates everything a call can get wrong before any work — prompts, sampling, per-prompt cartridges
and tools_kwargs, limits, what the backend can serve — and tokenizes. `Request.dataproto` is the veRL input:
each prompt repeated n times (prompt-major, as veRL's trainer repeats rows), with the flags that ask the
backend for each row's engine record (final.outputs.ROW_INFO) and, for tool calls, their trace.
`prepare_score` is the same for InferenceEngine.score: each prompt's tokens with its continuation appended,
asking for every token's logprob and nothing generated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from final.adapters import adapters_per_prompt, check_adapters
from final.chat_template import ChatOptions
from final.errors import CartridgeError, ConfigError, PromptError, SamplingError, ToolsError, UnsupportedError
from final.outputs import (CALL_TOOLS, PROMPT_LOGPROBS, ROW_INFO, SINGLE_TURN, TEMPLATE_KWARGS, TOP_LOGPROBS, TRACE_KEY,
                           Score, scores_of)
from final.prompts import (Prompt, build_dataproto, normalize_prompts, prompt_items, tokenize,
                           tokenize_continuations)
from final.protocol.cartridge_spec import REQUEST_CARTRIDGE_KEYS, check_cartridge_name, check_cartridge_spec
from final.sampling import CONSTRAINT_KEYS, Limits, Sampling, check_top_logprobs, parse_sampling, row_seed


@dataclass(frozen=True)
class ChatCall:
    """What a call adds to its conversations beyond sampling (final.tools.call.plan_call builds it): the rendering
    (tools, call format, template variables), how its rows are read (`reply`: final.tools.reply.ReplyPlan, opaque
    here), the constraint sampling keys it adds, and with max_turns the tools the multi-turn loop runs (`toolset`:
    final.tools.registry.ToolSet). tool_names: the offered tools' names."""

    options: ChatOptions
    reply: Any = None
    constraint: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    toolset: Any = None
    max_turns: int | None = None
    keep_ids: tuple[int, ...] = ()
    tool_names: tuple[str, ...] = ()
    constraint_field: str = "tool_choice"  # the field that asked for `constraint` (tool_choice or response_format)

    @property
    def runs_tools(self) -> bool:
        return self.toolset is not None


@dataclass
class Request:
    prompts: list[Prompt]
    ids: list[list[int]]  # token ids per prompt
    sampling: Sampling
    cartridges: list[tuple[Any, ...]] | None = None  # per prompt: ids or specs, composed in order
    tools_kwargs: list[dict] | None = None  # per prompt (multi-turn)
    show_progress: bool = False
    continuation_starts: list[int] | None = None  # scoring: where each prompt's continuation begins in ids
    score_top_logprobs: int = 0  # scoring: the alternatives the caller asked for (the call asks for >= 1)
    adapters: list[str | None] | None = None  # per prompt: a LoRA adapter's name (None: the base)
    chat: ChatCall | None = None  # tools, template variables, output reading (ChatCall)

    @property
    def n(self) -> int:
        return self.sampling.n

    @property
    def reply(self) -> Any:
        """How the call's rows are read (final.tools.reply.ReplyPlan), None: as plain text."""
        return self.chat.reply if self.chat is not None else None

    @property
    def rows(self) -> int:
        return len(self.ids) * self.sampling.n

    def cartridge_refs(self) -> list[Any]:
        """Every cartridge the request names (ids and specs), for loading and holding them while it runs."""
        return [c for row in self.cartridges or [] for c in row]

    def scores(self, metadata: list[dict]) -> list[Score]:
        """A scoring request's output metadata (GenerationOutput.metadata) -> one Score per prompt."""
        return scores_of(self.ids, self.continuation_starts, metadata, self.score_top_logprobs)

    def part(self, p0: int, p1: int, s0: int, k: int) -> "Request":
        """Samples [s0, s0+k) of prompts [p0, p1) as a request of their own, each row keeping the seed it has in
        this one (a replica of a pool runs it)."""
        params = dict(self.sampling.params)
        if self.sampling.seed is not None:
            params["seed"] = row_seed(self.sampling.seed, p0 * self.n + s0)  # the part's first row, globally
        cut = (lambda values: None if values is None else values[p0:p1])  # noqa: E731
        chat = self.chat
        if chat is not None and chat.reply is not None and getattr(chat.reply, "forced", None):
            chat = dataclasses.replace(chat, reply=dataclasses.replace(chat.reply, forced=chat.reply.forced[p0:p1]))
        return Request(self.prompts[p0:p1], self.ids[p0:p1], dataclasses.replace(self.sampling, params=params, n=k),
                       cut(self.cartridges), cut(self.tools_kwargs), False, cut(self.continuation_starts),
                       self.score_top_logprobs, cut(self.adapters), chat)

    def dataproto(self, pad_token_id: int, eos_token_ids: list[int], cartridge_ids: list[tuple[str, ...]] | None):
        """The veRL DataProto of this request: rows prompt-major (prompt i's samples are rows i*n .. i*n+n-1)."""
        n = self.sampling.n
        rep = (lambda values: [v for v in values for _ in range(n)])  # noqa: E731
        non_tensor: dict[str, list] = {}
        if cartridge_ids is not None:
            non_tensor["cartridges"] = rep(cartridge_ids)
        if self.tools_kwargs is not None:
            non_tensor["tools_kwargs"] = rep(self.tools_kwargs)
        if self.adapters is not None:
            non_tensor["adapters"] = rep(self.adapters)
        meta = {"do_sample": self.sampling.do_sample, ROW_INFO: True, TRACE_KEY: self.tools_kwargs is not None,
                **self._chat_meta()}
        if self.sampling.prompt_logprobs:
            meta[PROMPT_LOGPROBS] = True
        if self.sampling.top_logprobs:
            meta[TOP_LOGPROBS] = self.sampling.top_logprobs
        eos = sorted(set(eos_token_ids) | set(self.sampling.params.get("stop_token_ids") or []))
        return build_dataproto(rep(self.ids), rep(self.prompts), pad_token_id, eos, meta_info=meta,
                               non_tensor=non_tensor)

    def _chat_meta(self) -> dict:
        """The meta_info a backend reads of a call's chat: the loop's tools (max_turns), or a single turn (tools
        only parsed: no tools.yaml loop), and the template variables the multi-turn loop renders with."""
        chat = self.chat
        if chat is None:
            return {}
        meta: dict = {TEMPLATE_KWARGS: dict(chat.options.template_kwargs)} if chat.options.template_kwargs else {}
        if chat.runs_tools:
            meta[CALL_TOOLS] = {"tools": chat.toolset, "format": chat.options.family, "max_turns": chat.max_turns,
                                "schemas": list(chat.options.tools or ())}
        elif chat.options.tools is not None:
            meta[SINGLE_TURN] = True
        return meta


@dataclass
class CallRules:
    """What preparing a call needs to know of the engine that will run it (an InferenceEngine, or a pool of them).
    tool_names is None unless the backend runs multi-turn tool calling; cartridge_ids() is None when the engine
    keeps no cartridge store (then it may only name ids the backend knows, and no specs)."""

    tokenizer: Any
    prompt_length: int
    response_length: int
    limits: Limits
    backend: str
    capabilities: Any  # final.rollout.base.Capabilities
    tool_names: list[str] | None
    cartridge_ids: Callable[[], list[str] | None]
    known_ids: Callable[[], list[str] | None]  # ids a request may name (the store's, or the backend's)
    progress: bool = True
    progress_min_rows: int = 32
    adapter_names: Callable[[], list[str]] = list  # the LoRA adapters a call may name


def prepare(prompts: Any, rules: CallRules, *, sampling: dict[str, Any], raw: bool = False, cartridge: Any = None,
            tools_kwargs: Any = None, progress: bool | None = None, continuations: Any = None,
            adapter: Any = None, chat: ChatCall | None = None) -> Request:
    """Validate and tokenize one call; raises the typed errors of final.errors, and nothing has run when it does.
    continuations (scoring): token ids or text appended to each prompt's tokens. chat: the call's tools, template
    variables and constraint (final.tools.call.plan_call)."""
    limits = rules.limits
    parsed = parse_sampling(_with_constraint(sampling, chat), response_length=rules.response_length, limits=limits)
    items = normalize_prompts(prompts, raw=raw)
    if len(items) > limits.max_prompts:
        raise PromptError(f"{len(items)} prompts exceed limits.max_prompts={limits.max_prompts}")
    if len(items) * parsed.n > limits.max_queued_rows:  # it could never be admitted: refuse it now, not with 429s
        raise SamplingError(f"{len(items)} prompts x n={parsed.n} = {len(items) * parsed.n} rows exceed "
                            f"limits.max_queued_rows={limits.max_queued_rows}", "n")
    _check_stop_ids(parsed, len(rules.tokenizer))
    carts = cartridges_per_prompt(cartridge, len(items))
    _check_chat(items, carts, chat)
    ids = tokenize(items, rules.tokenizer, rules.prompt_length,
                   after_cartridge=[bool(c) for c in carts] if carts else None,
                   chat=chat.options if chat is not None else None)
    starts = None
    if continuations is not None:  # a continuation takes the place of a response: at most response_length tokens
        starts = [len(i) for i in ids]
        ids = [i + c for i, c in zip(ids, tokenize_continuations(continuations, len(ids), rules.tokenizer,
                                                                  rules.response_length))]
    # a scoring call is no conversation: it takes the batch path even where tools are on
    kwargs = _tools_kwargs(items, parsed, tools_kwargs, None if starts is not None else _loop_tools(rules, chat,
                                                                                                    tools_kwargs))
    adapters = adapters_per_prompt(adapter, len(items))
    try:
        rules.capabilities.check(rules.backend, parsed, cartridges=carts is not None, tools=kwargs is not None,
                                 adapters=adapters is not None, call_tools=chat is not None and chat.runs_tools)
    except UnsupportedError as exc:
        raise _as_asked(exc, chat) from None
    check_adapters(adapters, rules.adapter_names, rules.backend, tools=kwargs is not None)
    if kwargs is not None and chat is not None and chat.options.template_kwargs and not rules.capabilities.call_tools:
        raise UnsupportedError(rules.backend, "chat_template_kwargs", f"the {rules.backend} backend's multi-turn "
                               "loop renders conversations its own way, without template variables")
    request = Request(items, ids, parsed, carts, kwargs, continuation_starts=starts, adapters=adapters, chat=chat)
    _check_cartridges(request, rules)
    show = rules.progress if progress is None else progress
    request.show_progress = bool(show) and request.rows >= rules.progress_min_rows
    return request


def _with_constraint(sampling: dict[str, Any], chat: ChatCall | None) -> dict[str, Any]:
    """The call's sampling keys with its tools' / response_format's constraint (at most one per call)."""
    if chat is None or not chat.constraint:
        return sampling
    given = [k for k in CONSTRAINT_KEYS if sampling.get(k) is not None]
    if given:
        raise ToolsError(f"asks for a constraint and so does the sampling key {given[0]!r}: a call takes one",
                         chat.constraint_field)
    return {**sampling, **chat.constraint}


def _as_asked(exc: UnsupportedError, chat: ChatCall | None) -> UnsupportedError:
    """A backend's refusal of the constraint a call's tool_choice or response_format asked for, named as asked."""
    if chat is None or exc.field not in chat.constraint:
        return exc
    return UnsupportedError(exc.backend, chat.constraint_field, f"needs constrained decoding ({exc.field}): "
                            f"{exc.args[0]}")


def _check_chat(items: list[Prompt], carts: list | None, chat: ChatCall | None) -> None:
    if chat is None or chat.options.tools is None and not chat.options.template_kwargs:
        return
    field = "tools" if chat.options.tools is not None else "chat_template_kwargs"
    if any(p.messages is None for p in items):
        raise ToolsError("are rendered by the chat template: give chat prompts (strings or message lists), not raw "
                         "text or token ids", field)
    if carts is not None and chat.options.tools is not None:
        raise ToolsError("cannot go with a cartridge: a chat template renders tools in the system turn, which a "
                         "cartridge stands for", "tools")


def _loop_tools(rules: CallRules, chat: ChatCall | None, tools_kwargs: Any) -> list[str] | None:
    """The tools a call's multi-turn loop runs: the call's own (max_turns), none where its tools are only parsed
    (a single turn, also on an engine with tools.yaml), else the engine's (tools.yaml)."""
    if chat is None or chat.options.tools is None:
        return rules.tool_names
    if chat.runs_tools:
        return list(chat.tool_names)
    if tools_kwargs is not None:
        raise ToolsError("configure tools that run; these tools are only offered (give max_turns to run them)",
                         "tools_kwargs")
    return None


def prepare_score(prompts: Any, continuations: Any, rules: CallRules, *, top_logprobs: int = 0, raw: bool = False,
                  cartridge: Any = None, chat: ChatCall | None = None) -> Request:
    """InferenceEngine.score's call: every token's logprob, the k best alternatives (at least one, for the greedy
    check), nothing generated, greedy (no seed or temperature moves a logprob)."""
    check_top_logprobs(top_logprobs, rules.limits)
    request = prepare(prompts, rules, sampling={"max_tokens": 0, "temperature": 0.0, "prompt_logprobs": True,
                                                "top_logprobs": max(top_logprobs, 1)},
                      raw=raw, cartridge=cartridge, progress=False, chat=chat,
                      continuations=[None] * len(prompt_items(prompts)) if continuations is None else continuations)
    request.score_top_logprobs = top_logprobs
    return request


def _check_stop_ids(parsed: Sampling, vocab: int) -> None:
    """Stop token ids past the vocabulary can never be sampled, and index past the logits when min_new_tokens
    masks them: refused like out-of-vocabulary prompt ids."""
    bad = [i for i in parsed.params.get("stop_token_ids") or [] if i >= vocab]
    if bad:
        raise SamplingError(f"token ids {bad[:5]} are outside the vocabulary of {vocab}", "stop_token_ids")


def _tools_kwargs(items: list[Prompt], parsed: Sampling, tools_kwargs: Any, tool_names: list[str] | None
                  ) -> list[dict] | None:
    if tool_names is None:
        if tools_kwargs is not None:
            raise ConfigError("tools_kwargs needs tool calling: set rollout.multi_turn.enable: true and "
                              "tool_config_path", key="rollout.multi_turn.enable")
        return None
    if any(p.messages is None for p in items):
        raise PromptError("multi-turn tool calling needs chat prompts (strings or message lists), not raw text "
                          "or token ids")
    asked = [f for f, on in (("logprobs", parsed.logprobs), ("prompt_logprobs", parsed.prompt_logprobs)) if on]
    if asked:  # (top_logprobs implies logprobs)
        raise SamplingError("per-token logprobs are for single-turn calls; a multi-turn call returns veRL's "
                            "rollout_log_probs in its DataProto (rollout.calculate_log_probs); score a "
                            "conversation's tokens with InferenceEngine.score", asked[0])
    # each row offers the tools named in its tools_kwargs (veRL); default: every tool, no kwargs
    return per_prompt({name: {} for name in tool_names} if tools_kwargs is None else tools_kwargs, len(items))


def _check_cartridges(request: Request, rules: CallRules) -> None:
    """Unknown ids and malformed specs are refused now; specs are loaded when the call runs."""
    refs = request.cartridge_refs()
    if not refs:
        return
    for ref in refs:  # an id is a name too: refused as the spec's would be (and never quoted whole)
        if isinstance(ref, str):
            check_cartridge_name(ref, "cartridge")
    specs = [r for r in refs if isinstance(r, Mapping)]
    if specs and rules.cartridge_ids() is None:
        raise CartridgeError(f"the {rules.backend} backend loads no cartridges from requests; name the ids of its "
                             f"configured cartridges", field="cartridges")
    for i, spec in enumerate(specs):
        check_cartridge_spec(dict(spec), f"cartridges[{i}]", REQUEST_CARTRIDGE_KEYS, request=True)
    known = rules.known_ids() or []
    missing = sorted({r for r in refs if isinstance(r, str)} - set(known))
    if missing:
        raise CartridgeError(f"unknown cartridge id(s) {missing}; loaded: {sorted(known)}", field="cartridge")


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
