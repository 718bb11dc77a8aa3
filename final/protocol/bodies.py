"""Request bodies of the Tokasaurus protocol, validated strictly (unknown fields and wrong types are 400s).

Field for field from ScalingIntelligence/tokasaurus (branch geoff/cartridges) tokasaurus/server/types.py:
Cartridge, CompletionsRequest, ChatCompletionRequest, CartridgeCompletionsRequest,
CartridgeChatCompletionRequest (they forbid extra fields too). Defaults are Tokasaurus': completions
max_tokens=16 and temperature=1.0, chat temperature=0.7, cartridge source "wandb".
Additions of ours, marked below: top_k, min_p, repetition_penalty (as vLLM/SGLang's OpenAI servers accept),
a cartridge's `positions`, "s3" as a cartridge source (final.cartridges.sources), and /generate's body (seed 001's native protocol).

Chat bodies also take OpenAI's tool-calling fields (tools, tool_choice, parallel_tool_calls, response_format), the
chat template's variables (chat_template_kwargs, SGLang's and vLLM's field; reasoning_effort goes to the template as
they pass it), and the fields OpenAI clients send that change nothing here (IGNORED: accepted, logged once per
field, as vLLM logs ignored fields). Fields that would change the output and are not served (UNSERVED) are refused
naming the field. The tool fields are checked by final.tools.spec (a 400 naming e.g. `tools[0].function.name`).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union, get_args

from pydantic import BaseModel, ConfigDict, Field

from final.errors import ConfigError

CartridgeSource = Literal["wandb", "local", "huggingface", "s3"]
CartridgePositions = Literal["after_prefix", "from_zero"]


class _Strict(BaseModel):
    # JSON types are taken as sent: "5" is not an int, true is not a number; NaN and Infinity (which Python's
    # json sends) are not numbers either, so a non-finite float is a 400 naming its field before any work.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Cartridge(_Strict):
    id: str = Field(min_length=1)
    source: CartridgeSource = "wandb"
    force_redownload: bool = False
    # ours: where the tokens after the cartridge were in training (final.cartridges.positions); None: the
    # cartridge's manifest or run config says, else after_prefix
    positions: Optional[CartridgePositions] = None


WIRE_CARTRIDGE_KEYS = ("id", "source", "force_redownload")  # Tokasaurus' fields
CARTRIDGE_SOURCES = get_args(CartridgeSource)
CARTRIDGE_POSITIONS = get_args(CartridgePositions)
SOURCE_ALIASES = {"hf": "huggingface"}  # --cartridge-sources local,hf,s3,wandb


def check_cartridge_sources(value: Any, path: str | None = None, key: str = "cartridge_sources") -> tuple[str, ...]:
    """`cartridge_sources` (and `final serve --cartridge-sources`): which sources HTTP requests may name, a list
    or comma-separated string of local, hf (huggingface), s3, wandb. Remote ones download with the server's own
    credentials, so they are off unless listed."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise ConfigError(f"must be a list of sources (local, hf, s3, wandb), got {value!r}", key=key, path=path)
    out = [SOURCE_ALIASES.get(s.strip(), s.strip()) for s in items if s.strip()]
    for name in out:
        if name not in CARTRIDGE_SOURCES:
            raise ConfigError(f"unknown source {name!r}; choose from local, hf, s3, wandb", key=key, path=path)
    return tuple(dict.fromkeys(out))


class StreamOptions(_Strict):
    include_usage: Optional[bool] = False


# OpenAI chat fields that change nothing a server without accounts, storage or tiers returns: accepted, ignored
IGNORED = ("store", "metadata", "user", "service_tier", "prompt_cache_key", "prompt_cache_retention",
           "safety_identifier", "prediction")
# OpenAI chat fields that would change the output, and what is served instead
UNSERVED = {"functions": "use tools", "function_call": "use tool_choice", "audio": "text only",
            "verbosity": "not served", "web_search_options": "no web search here"}


class _Sampling(_Strict):
    model: str
    frequency_penalty: Optional[float] = 0.0
    presence_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict[str, float]] = None
    n: Optional[int] = 1
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    top_p: Optional[float] = 1.0
    user: Optional[str] = None
    metadata: Optional[dict[str, Any]] = None
    ignore_eos: bool = False
    logprobs_in_fingerprint: bool = False
    # ours (vLLM/SGLang extensions)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    # SGLang's constraint fields (extra body): at most one per request, or response_format
    regex: Optional[str] = None
    ebnf: Optional[str] = None


class CompletionsRequest(_Sampling):
    prompt: Union[list[int], list[list[int]], str, list[str]]
    json_schema: Optional[Union[str, dict[str, Any]]] = None  # SGLang's (a JSON schema, as text or an object)
    response_format: Optional[dict[str, Any]] = None  # OpenAI's json_object / json_schema, as on chat
    best_of: Optional[int] = None
    echo: Optional[bool] = False
    logprobs: Optional[int] = None
    max_tokens: Optional[int] = 16
    suffix: Optional[str] = None
    temperature: Optional[float] = 1.0


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]]
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    # OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {...}} (checked by final.tools.spec)
    response_format: Optional[dict[str, Any]] = None
    temperature: Optional[float] = 0.7
    apply_chat_template_overrides: Optional[dict[str, Any]] = None
    # tool calling (OpenAI's fields; final.tools.spec checks their contents)
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    # ours (SGLang's and vLLM's): the chat template's variables, e.g. {"enable_thinking": false}
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[Literal["minimal", "low", "medium", "high"]] = None  # a template variable
    modalities: Optional[list[str]] = None  # ["text"] only
    # accepted and ignored (IGNORED; metadata and user come with _Sampling)
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    safety_identifier: Optional[str] = None
    prediction: Optional[dict[str, Any]] = None
    # refused naming the field when given (UNSERVED)
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    verbosity: Optional[Any] = None
    web_search_options: Optional[Any] = None


class CartridgeCompletionsRequest(CompletionsRequest):
    cartridges: Optional[list[Cartridge]] = None


class CartridgeChatCompletionRequest(ChatCompletionRequest):
    cartridges: Optional[list[Cartridge]] = None


class GenerateRequest(_Strict):
    """Seed 001's `protocol: toka` body for POST /generate (not an endpoint of real Tokasaurus)."""

    prompt: str
    model: Optional[str] = None
    system: Optional[str] = None
    temperature: Optional[float] = 0.0
    max_tokens: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    cartridges: Optional[list[Cartridge]] = None
