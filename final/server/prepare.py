"""HTTP request bodies -> Jobs: prompts tokenized by final.prompts, OpenAI parameters -> SGLang sampling keys.

Everything a request may get wrong is checked here, before any engine work, and raised as a typed error
(PromptError, SamplingError) that the app turns into a 400 naming the field. Parameters Tokasaurus refuses
(echo, best_of, suffix, logit_bias, top-k logprobs without max_topk_logprobs) are refused the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from final.engine.sampling_params import SamplingParams
from final.errors import PromptError, SamplingError
from final.prompts import normalize_prompts, tokenize
from final.server.generation import Job
from final.server.protocol import ChatCompletionRequest, CompletionsRequest, GenerateRequest


@dataclass
class Limits:
    tokenizer: Any
    prompt_length: int
    response_length: int


def completion_job(req: CompletionsRequest, limits: Limits) -> Job:
    if req.echo:
        raise SamplingError("echo is not supported", "echo")
    if req.best_of not in (None, 1):
        raise SamplingError("best_of is not supported", "best_of")
    if req.suffix is not None:
        raise SamplingError("suffix is not supported", "suffix")
    if req.logprobs is not None and req.logprobs < 0:
        raise SamplingError("must be >= 0", "logprobs")
    if req.logprobs:  # Tokasaurus, too, refuses top-k logprobs unless started with max_topk_logprobs
        raise SamplingError("top logprobs are not supported; use logprobs=0 for the chosen tokens' logprobs",
                            "logprobs")
    cartridges = _specs(req)
    items = normalize_prompts(req.prompt, raw=True)  # text is sent as is (the tokenizer's BOS, no template)
    ids = tokenize(items, limits.tokenizer, limits.prompt_length, after_cartridge=[bool(cartridges)] * len(items))
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    want_logprobs = req.logprobs is not None or req.logprobs_in_fingerprint
    return Job(ids, _sampling(req, max_tokens, limits), _n(req), want_logprobs, cartridges)


def chat_job(req: ChatCompletionRequest, limits: Limits) -> Job:
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise SamplingError("needs logprobs: true", "top_logprobs")
        if req.top_logprobs < 0:
            raise SamplingError("must be >= 0", "top_logprobs")
        if req.top_logprobs > 0:
            raise SamplingError("top logprobs are not supported; logprobs: true gives the chosen tokens' logprobs",
                                "top_logprobs")
    if req.response_format is not None and req.response_format.type != "text":
        raise SamplingError(f"{req.response_format.type!r} is not supported (only 'text')", "response_format")
    if req.apply_chat_template_overrides:
        raise SamplingError("chat template overrides are not supported", "apply_chat_template_overrides")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise SamplingError("give max_tokens or max_completion_tokens, not both", "max_tokens")
    max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    if max_tokens is None:
        max_tokens = limits.response_length
    cartridges = _specs(req)
    ids = _chat_ids(req.messages, limits, bool(cartridges))
    return Job(ids, _sampling(req, max_tokens, limits), _n(req), bool(req.logprobs) or req.logprobs_in_fingerprint,
               cartridges)


def generate_job(req: GenerateRequest, limits: Limits) -> Job:
    """Seed 001's native body: an optional system prompt and one user prompt."""
    if not req.prompt.strip():
        raise PromptError("is an empty string")
    messages = ([{"role": "system", "content": req.system}] if req.system is not None else []) + \
        [{"role": "user", "content": req.prompt}]
    cartridges = _specs(req)
    max_tokens = limits.response_length if req.max_tokens is None else req.max_tokens
    return Job(_chat_ids(messages, limits, bool(cartridges)), _sampling(req, max_tokens, limits), 1, False,
               cartridges)


def _chat_ids(messages: list[dict], limits: Limits, after_cartridge: bool) -> list[list[int]]:
    if not messages:
        raise PromptError("messages is empty")
    items = normalize_prompts([[_flatten_content(m, j) for j, m in enumerate(messages)]])
    return tokenize(items, limits.tokenizer, limits.prompt_length, after_cartridge=[after_cartridge])


def _flatten_content(message: dict, j: int) -> dict:
    """OpenAI content parts -> a string, as Tokasaurus does: exactly one part, of type text."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    if len(content) != 1 or not isinstance(content[0], dict) or content[0].get("type") != "text" \
            or not isinstance(content[0].get("text"), str):
        raise PromptError(f"message {j}: content parts must be exactly one {{'type': 'text', 'text': ...}}")
    return {**message, "content": content[0]["text"]}


def _specs(req: Any) -> list[dict]:
    return [c.model_dump() for c in getattr(req, "cartridges", None) or []]


def _n(req: Any) -> int:
    return 1 if req.n is None else req.n


def _sampling(req: Any, max_tokens: int, limits: Limits) -> dict[str, Any]:
    """OpenAI/Tokasaurus fields -> SGLang sampling keys, range-checked by the engine's SamplingParams."""
    if max_tokens < 1:
        raise SamplingError(f"must be >= 1, got {max_tokens}", "max_tokens")
    if max_tokens > limits.response_length:
        raise SamplingError(f"{max_tokens} exceeds the server's rollout.response_length={limits.response_length}",
                            "max_tokens")
    if getattr(req, "logit_bias", None):
        raise SamplingError("is not supported", "logit_bias")
    stop = req.stop
    params: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": 0.0 if req.temperature is None else req.temperature,  # Tokasaurus: None means greedy
        "stop": [stop] if isinstance(stop, str) else list(stop or []),
        "seed": req.seed,
    }
    for key in ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if getattr(req, key, None) is not None:
            params[key] = getattr(req, key)
    if getattr(req, "ignore_eos", False):
        params["ignore_eos"] = True
    SamplingParams.from_dict({**params, "n": _n(req) if hasattr(req, "n") else 1})  # typed range errors
    return params
