"""A call's tool and output options -> final.request.ChatCall: what its prompts render (tools, the fallback, template
variables), the constraint it samples under, how its rows are read (calls, reasoning), and, with max_turns, the
tools the multi-turn loop runs. InferenceEngine and `final serve` both plan here, so they refuse and render alike.

    tools                 list of OpenAI tool dicts, veRL BaseTools, Python functions (final.tools.spec)
    tool_choice           none | auto | required | {"type": "function", "function": {"name"}}
    parallel_tool_calls   false: at most one call
    response_format       {"type": "json_object"} | {"type": "json_schema", "json_schema": {...}}
    chat_template_kwargs  template variables (enable_thinking, ...)
    max_turns             run the calls (callables, BaseTools) and go on, up to this many assistant turns
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from final.chat_template import SYNTAX, ChatOptions, check_template_kwargs, detect_family, vocabulary
from final.errors import ToolsError
from final.outputs import special_ids
from final.request import CallRules, ChatCall, Request, prepare
from final.tools.constraint import after_reasoning, response_constraint, tool_constraint
from final.tools.parser import ToolCallParser, check_format
from final.tools.reasoning import END, START, check_reasoning_parser, opens_reasoning, reasoning_enabled
from final.tools.reply import ReplyPlan
from final.tools.spec import check_parallel, check_response_format, check_tool_choice, tool_spec


CHAT_KEYS = ("tools", "tool_choice", "parallel_tool_calls", "response_format", "chat_template_kwargs", "max_turns")


@dataclass(frozen=True)
class Reading:
    """How an engine reads its rows: the tool-call format (FAMILIES name, or auto) and the reasoning parser."""

    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"

    @classmethod
    def of(cls, config: Any) -> "Reading":
        """An EngineConfig's tool_call_parser and reasoning_parser."""
        return cls(config.tool_call_parser, config.reasoning_parser)

    def family(self, tokenizer: Any) -> str:
        fmt = check_format(self.tool_call_parser, "tool_call_parser")
        return detect_family(tokenizer) if fmt == "auto" else fmt

    def reasoning(self, tokenizer: Any) -> bool:
        return reasoning_enabled(check_reasoning_parser(self.reasoning_parser), tokenizer)


def prepare_call(prompts: Any, rules: CallRules, reading: Reading, *, sampling: dict[str, Any],
                 chat: dict[str, Any] | None = None, **options: Any) -> Request:
    """final.request.prepare with a call's chat options (`chat`, and CHAT_KEYS given among the sampling keywords):
    what InferenceEngine.prepare and a pool's prepare do."""
    sampling = dict(sampling)
    asked = {**{k: sampling.pop(k) for k in CHAT_KEYS if k in sampling}, **(chat or {})}
    request = prepare(prompts, rules, sampling=sampling, chat=plan_call(rules.tokenizer, reading, **asked), **options)
    request.chat = with_prompts(request.chat, request.ids, rules.tokenizer, reading)
    return request


def plan_call(tokenizer: Any, reading: Reading, *, tools: Any = None, tool_choice: Any = None,
              parallel_tool_calls: Any = None, response_format: Any = None, chat_template_kwargs: Any = None,
              max_turns: Any = None) -> ChatCall | None:
    """The call's ChatCall (None: it asks for none of this and the model splits no reasoning). ToolsError names
    the field that cannot be served."""
    spec = tool_spec(tools)
    choice = check_tool_choice(tool_choice, spec)
    parallel = check_parallel(parallel_tool_calls)
    fmt = check_response_format(response_format)
    kwargs = check_template_kwargs(chat_template_kwargs)
    turns = _check_max_turns(max_turns, spec)
    thinking = reading.reasoning(tokenizer)
    if spec is None and fmt is None and not kwargs and not thinking:
        return None
    family = reading.family(tokenizer)
    constraint = tool_constraint(family, spec.schemas, choice, parallel) if spec is not None else {}
    json_keys = response_constraint(fmt)
    if constraint and json_keys:
        raise ToolsError("cannot hold one output to both a tool call and a JSON schema; drop one, or use "
                         "tool_choice auto", "response_format")
    constraint = constraint or json_keys
    if thinking and kwargs.get("enable_thinking") is not False:
        constraint = after_reasoning(constraint)
    parser = ToolCallParser(family) if spec is not None and choice != "none" else None
    reply = ReplyPlan(parser, thinking, parallel, keep_ids=_keep_ids(tokenizer, family if parser else None, thinking))
    return ChatCall(ChatOptions(tuple(spec.schemas) if spec else None, family, kwargs), reply, constraint,
                    spec.toolset if turns else None, turns, reply.keep_ids, tuple(spec.names()) if spec else (),
                    "response_format" if json_keys else "tool_choice")


def template_call(chat_template_kwargs: Any) -> ChatCall | None:
    """A call that only sets chat template variables (score's)."""
    kwargs = check_template_kwargs(chat_template_kwargs)
    return ChatCall(ChatOptions(template_kwargs=kwargs)) if kwargs else None


def _check_max_turns(value: Any, spec: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ToolsError(f"must be a positive integer, got {value!r:.40}", "max_turns")
    if spec is None:
        raise ToolsError("runs the tools the model calls: give tools (Python functions or veRL BaseTools)",
                         "max_turns")
    missing = [n for n in spec.names() if n not in spec.toolset]
    if missing:
        raise ToolsError(f"{missing[0]!r} is a schema with nothing to run it; with max_turns every tool must be a "
                         "Python function or a veRL BaseTool", "tools")
    return value


def _keep_ids(tokenizer: Any, family: str | None, thinking: bool) -> tuple[int, ...]:
    """Special tokens that mark calls or reasoning: decoded text keeps them (skip_special_tokens drops the rest)."""
    markers = []
    if family is not None:
        markers += [SYNTAX[family].start.strip(), "</tool_call>"]
    if thinking:
        markers += [START, END]
    special = special_ids(tokenizer)
    vocab = vocabulary(tokenizer)
    return tuple(sorted({vocab[m] for m in markers if m in vocab and vocab[m] in special}))


def with_prompts(chat: ChatCall | None, prompt_ids: list[list[int]], tokenizer: Any, reading: Reading
                 ) -> ChatCall | None:
    """The call's ChatCall once its prompts are tokenized: which of them open a reasoning block (their generation
    prompt ends with <think>, as Qwen3-thinking's and DeepSeek-R1's do)."""
    if chat is None or chat.reply is None or not chat.reply.reasoning:
        return chat
    forced = tuple(opens_reasoning(tokenizer.decode(ids[-8:]), reading.reasoning_parser) for ids in prompt_ids)
    return dataclasses.replace(chat, reply=dataclasses.replace(chat.reply, forced=forced))
