"""A conversation with tools -> prompt text: the one rendering rule every entry point uses (generate's chat
prompts, `final serve`'s messages, score), so the model reads the same text whichever way the call came in.

`render_chat(tokenizer, messages, options)` is `apply_chat_template(messages, tools=..., add_generation_prompt=True,
**chat_template_kwargs)` where the model's template can render what the conversation holds; where it cannot (a
ChatML template such as SmolLM2's ignores `tools` and drops an assistant message's `tool_calls`), the documented
fallback:
- tools: `FALLBACK_TOOLS` (the Hermes-style block Qwen2.5's template writes, and what the tool-use cartridges are
  trained on) appended to the system message, or as the system message when the conversation has none;
- an assistant message's `tool_calls`: written into its content in the model's own call format (CallSyntax.render,
  what the parser reads back), so the next turn reads the calls it made;
- a `role: "tool"` message, where the template refuses that role: a user turn holding
  `<tool_response>\\n...\\n</tool_response>`, as Qwen2.5's template writes tool results.
What a template can render is probed once per template text (`capabilities`).

The call formats themselves (`SYNTAX`: the markers the tool-call parser of final/tools/parser.py reads and the
constraint of final/tools/constraint.py writes) live here, below both, so core can render a call without importing
the tools layer. `detect_family` picks one from the tokenizer as SGLang and vLLM do (their names: hermes, qwen25,
llama3, mistral).
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

from final.errors import PromptError, ToolsError

FAMILIES = ("hermes", "qwen25", "llama3", "mistral")
TOOL_CALL_PARSERS = (*FAMILIES, "auto")  # the config's tool_call_parser (final/tools/parser.py)
REASONING_PARSERS = ("auto", "none", "qwen3", "deepseek_r1")  # the config's reasoning_parser (final/tools/reasoning.py)
FALLBACK_TOOLS = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
                  "provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
                  "For each function call, return a json object with function name and arguments within "
                  "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
                  "<args-json-object>}}\n</tool_call>")
# apply_chat_template's own parameters: a request's chat_template_kwargs may not set them
RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                             "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                             "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
MAX_KWARGS_BYTES = 16384


@dataclass(frozen=True)
class CallSyntax:
    """How one family writes tool calls: `start` opens a call (or, with `array`, a JSON array of calls), `end`
    closes it ("" where the call ends with its JSON), `separator` stands between two calls."""

    name: str
    start: str
    end: str
    separator: str
    args_key: str = "arguments"
    array: bool = False
    starts_bare: bool = False  # a call may also start with its JSON object, no marker (llama3 at the text's start)

    def render(self, calls: list[tuple[str, Any]]) -> str:
        """The text the model writes for these (name, arguments) calls."""
        objs = [json.dumps({"name": n, self.args_key: a}, ensure_ascii=False) for n, a in calls]
        if self.array:
            return f"{self.start} [{', '.join(objs)}]"
        return self.separator.join(f"{self.start}{o}{self.end}" for o in objs)


SYNTAX = {
    "hermes": CallSyntax("hermes", "<tool_call>\n", "\n</tool_call>", "\n"),
    "qwen25": CallSyntax("qwen25", "<tool_call>\n", "\n</tool_call>", "\n"),
    "llama3": CallSyntax("llama3", "<|python_tag|>", "", ";", args_key="parameters", starts_bare=True),
    "mistral": CallSyntax("mistral", "[TOOL_CALLS]", "", ", ", array=True),
}
# vocabulary markers by which detect_family knows a family (SGLang's vocabulary detection for qwen25)
_MARKERS = (("qwen25", ("<tool_call>", "</tool_call>")), ("llama3", ("<|python_tag|>",)), ("mistral", ("[TOOL_CALLS]",)))


def detect_family(tokenizer: Any) -> str:
    """The tool-call family of a tokenizer: qwen25 when <tool_call> and </tool_call> are tokens (SGLang's rule),
    llama3 with <|python_tag|>, mistral with [TOOL_CALLS]; else hermes (text-level <tool_call> tags, the format of
    the fallback prompt)."""
    vocab = vocabulary(tokenizer)
    for family, markers in _MARKERS:
        if all(m in vocab for m in markers):
            return family
    return "hermes"


def vocabulary(tokenizer: Any) -> dict:
    """The tokenizer's vocabulary (token -> id), read once per tokenizer: get_vocab() builds the whole dict from the
    Rust side every time (~100 ms for SmolLM2's 49k tokens on a busy host), and every call that plans tools asks."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)  # a processor wraps its tokenizer
    try:
        return _vocabs[tok]
    except (KeyError, TypeError):
        vocab = tok.get_vocab()
        try:
            _vocabs[tok] = vocab
        except TypeError:  # not weak-referenceable: read it each time
            pass
        return vocab


_vocabs: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class ChatOptions:
    """What a call adds to its conversations' rendering: the OpenAI tool schemas offered (None: no tools), the
    call format of the model (a FAMILIES name, for the fallback) and the chat template's extra variables."""

    tools: tuple[dict, ...] | None = None
    family: str = "hermes"
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Capabilities:
    """What a chat template renders itself (probed with a throwaway conversation)."""

    tools: bool
    tool_calls: bool
    tool_role: bool


_PROBE_TOOL = {"type": "function", "function": {"name": "final_probe_fn", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_probed: dict[str, Capabilities] = {}
_probe_lock = threading.Lock()


def capabilities(tokenizer: Any) -> Capabilities:
    """What the tokenizer's chat template renders itself, probed once per template text."""
    key = str(getattr(tokenizer, "chat_template", None))
    with _probe_lock:
        if key not in _probed:
            _probed[key] = Capabilities(_renders_tools(tokenizer), _renders(tokenizer, _calling_turn(), "final_probe_fn"),
                                        _renders(tokenizer, _calling_turn() + [
                                            {"role": "tool", "tool_call_id": "call_0", "content": "final_probe_out"}],
                                            "final_probe_out"))
        return _probed[key]


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether apply_chat_template(tools=...) puts the tools in the prompt (SmolLM2's ChatML does not)."""
    return capabilities(tokenizer).tools


def _calling_turn() -> list[dict]:
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "final_probe_fn", "arguments": {}}}]}]


def _renders_tools(tokenizer: Any) -> bool:
    probe = [{"role": "user", "content": "hi"}]
    try:
        plain = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        return plain != tokenizer.apply_chat_template(probe, tools=[_PROBE_TOOL], tokenize=False,
                                                      add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
        return False


def _renders(tokenizer: Any, messages: list[dict], marker: str) -> bool:
    try:
        return marker in tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that raises on these messages cannot render them
        return False


def render_chat(tokenizer: Any, messages: list[dict], options: ChatOptions | None = None,
                add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation (see the module doc). PromptError when the template refuses it."""
    options = options or ChatOptions()
    kwargs = dict(options.template_kwargs)
    tools = list(options.tools) if options.tools else None
    plain = tools is None and not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if not plain:
        messages, tools = fallback_messages(tokenizer, messages, tools, options.family)
    try:
        if tools:
            kwargs["tools"] = tools
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **kwargs)
    except Exception as exc:  # noqa: BLE001 - Jinja's errors (raise_exception, undefined names) name the cause
        raise PromptError(f"the chat template cannot render this conversation: {type(exc).__name__}: {exc}") \
            from None


def fallback_messages(tokenizer: Any, messages: list[dict], tools: list[dict] | None,
                      family: str) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools handed to the template: what it cannot render, rewritten as the module doc says
    (tools None where they went into the system message)."""
    caps, syntax = capabilities(tokenizer), SYNTAX[family]
    out = [_assistant(m, caps.tool_calls, syntax) if m.get("role") == "assistant" else
           _tool_result(m) if m.get("role") == "tool" and not caps.tool_role else m for m in messages]
    if tools and not caps.tools:
        block = FALLBACK_TOOLS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": (out[0].get("content") or "") + block}
        else:
            out.insert(0, {"role": "system", "content": block.lstrip()})
        tools = None
    return out, tools


def _assistant(message: dict, renders_calls: bool, syntax: CallSyntax) -> dict:
    """An assistant message for the template: its calls' arguments as objects (what tool-use templates expect, as
    SGLang hands them), or, where the template drops calls, the calls written into its content."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = [(c["function"]["name"], arguments_object(c["function"].get("arguments"))) for c in calls]
    if renders_calls:
        return {**message, "content": message.get("content") or "",
                "tool_calls": [{**c, "function": {**c["function"], "arguments": a}} for c, (_, a) in zip(calls, parsed)]}
    text = message.get("content") or ""
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": (text + "\n" if text else "") + syntax.render(parsed)}


def _tool_result(message: dict) -> dict:
    return {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}


def arguments_object(arguments: Any) -> Any:
    """An OpenAI call's `arguments` (a JSON string, or already an object) as the object templates render."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments  # as sent: the template renders the text
    return {} if arguments is None else arguments


def check_template_kwargs(value: Any, field_name: str = "chat_template_kwargs") -> dict[str, Any]:
    """A call's chat_template_kwargs: a JSON object of template variables (enable_thinking, reasoning_effort, ...),
    none of apply_chat_template's own parameters, at most MAX_KWARGS_BYTES as JSON. ToolsError naming the key."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ToolsError(f"must be an object of template variables, got {type(value).__name__}", field_name)
    for key in value:
        if not isinstance(key, str) or not key.isidentifier():
            raise ToolsError(f"keys must be identifiers, got {key!r:.60}", field_name)
        if key in RESERVED_KWARGS:
            raise ToolsError(f"{key!r} is apply_chat_template's own parameter, not a template variable",
                             f"{field_name}.{key}")
    try:
        size = len(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ToolsError(f"must hold JSON values only ({exc})", field_name) from None
    if size > MAX_KWARGS_BYTES:
        raise ToolsError(f"{size} bytes as JSON exceed {MAX_KWARGS_BYTES}", field_name)
    return dict(value)
