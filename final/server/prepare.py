"""HTTP request bodies -> InferenceEngine.prepare: OpenAI's fields in generate()'s vocabulary.

Every check of a call lives in final/request.py and runs here before any engine work, so a bad body is a 400
naming the field and `final serve` refuses exactly what generate() refuses. What is particular to HTTP stays
here: OpenAI's defaults (completions max_tokens=16, temperature 1.0; chat 0.7), its parameter names, what
Tokasaurus refuses (best_of, suffix, logit_bias), and vLLM's scoring fields: `echo` (the prompt's tokens and their
logprobs before the completion's), `logprobs: k` and `max_tokens: 0` on completions, `top_logprobs: k` on chat.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from final.cartridges.sources import folder_file, sanitize_cartridge_id
from final.errors import CartridgeError, CartridgeSourceError, PromptError, SamplingError, UnsupportedError
from final.protocol.bodies import (IGNORED, UNSERVED, Cartridge, CartridgeChatCompletionRequest, ChatCompletionRequest,
                                   CompletionsRequest, GenerateRequest)
from final.protocol.cartridge_spec import MAX_PART_BYTES, REQUEST_CARTRIDGE_KEYS, check_cartridge_spec, shown
from final.request import Request
from final.sampling import CONSTRAINT_KEYS, check_params

logger = logging.getLogger(__name__)
_SAMPLING = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed")


@dataclass
class Call:
    """A prepared HTTP call: the engine request and how to answer it."""

    request: Request
    model: str | None
    chat: bool
    logprobs: bool = False  # render OpenAI logprobs
    top_logprobs: int = 0  # completions' logprobs: k / chat's top_logprobs: k
    echo: bool = False  # completions: the prompt's text and tokens come first
    fingerprint_logprobs: bool = False  # Tokasaurus' packed logprobs in system_fingerprint
    stream: bool = False
    include_usage: bool = False

    @property
    def prompt_param(self) -> str:
        return "messages" if self.chat else "prompt"


def completion_call(inference: Any, req: CompletionsRequest, specs: list[dict] | None = None,
                    adapter: str | None = None) -> Call:
    if req.best_of not in (None, 1):
        raise SamplingError("best_of is not supported", "best_of")
    if req.suffix is not None:
        raise SamplingError("suffix is not supported", "suffix")
    k = _top_count(inference, req.logprobs, "logprobs")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if req.echo and req.stream:
        raise SamplingError("echo is not supported with stream: true", "echo")
    if max_tokens == 0 and not req.echo:
        raise SamplingError("0 generates nothing: it is for scoring a prompt (echo: true)", "max_tokens")
    sampling = _sampling(req, max_tokens, req.logprobs is not None or req.logprobs_in_fingerprint)
    sampling["top_logprobs"] = k
    # echo's logprobs are the prompt's own (one forward pass); with max_tokens 0 the call is scoring only
    sampling["prompt_logprobs"] = bool(req.echo) and (req.logprobs is not None or max_tokens == 0)
    # text is sent as is (the tokenizer's BOS, no chat template)
    request = inference.prepare(req.prompt, raw=True, cartridge=specs, progress=False, **_adapter(adapter),
                                response_format=req.response_format, **sampling)
    return _call(request, req, chat=False, logprobs=req.logprobs is not None, top=k, echo=bool(req.echo))


def chat_call(inference: Any, req: ChatCompletionRequest, specs: list[dict] | None = None,
              adapter: str | None = None) -> Call:
    if req.top_logprobs is not None and not req.logprobs:
        raise SamplingError("needs logprobs: true", "top_logprobs")
    k = _top_count(inference, req.top_logprobs, "top_logprobs")
    _unserved_and_ignored(req)
    if req.apply_chat_template_overrides:
        raise SamplingError("chat template overrides are not supported", "apply_chat_template_overrides")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise SamplingError("give max_tokens or max_completion_tokens, not both", "max_tokens")
    max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    if max_tokens is None:
        max_tokens = inference.rollout_config.response_length
    if not req.messages:
        raise PromptError("messages is empty")
    messages = [_chat_message(m, j) for j, m in enumerate(req.messages)]
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:  # a template variable, as SGLang and vLLM pass it
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    request = inference.prepare([messages], cartridge=specs, progress=False, top_logprobs=k, **_adapter(adapter),
                                tools=req.tools, tool_choice=req.tool_choice, parallel_tool_calls=req.parallel_tool_calls,
                                response_format=req.response_format, chat_template_kwargs=kwargs or None,
                                **_sampling(req, max_tokens, bool(req.logprobs) or req.logprobs_in_fingerprint))
    return _call(request, req, chat=True, logprobs=bool(req.logprobs), top=k)


_ignored_logged: set[str] = set()


def _unserved_and_ignored(req: ChatCompletionRequest) -> None:
    """OpenAI fields that would change the answer and are not served: refused naming them. Fields that change
    nothing here (store, service_tier, ...): accepted, and logged once per field, as vLLM logs ignored fields."""
    for field, instead in UNSERVED.items():
        if getattr(req, field, None) is not None:
            raise UnsupportedError("final serve", field, f"is not served ({instead})")
    if req.modalities is not None and req.modalities != ["text"]:
        raise UnsupportedError("final serve", "modalities", f"only ['text'] is served, got {req.modalities!r:.80}")
    for field in IGNORED:
        if getattr(req, field, None) is not None and field not in _ignored_logged:
            _ignored_logged.add(field)
            logger.info("request field %r is accepted and ignored (it changes nothing this server returns)", field)


def _chat_message(message: dict, j: int) -> dict:
    """An OpenAI message as generate() takes it: content parts flattened, OpenAI's `developer` role as `system`."""
    message = _flatten_content(message, j)
    return {**message, "role": "system"} if message.get("role") == "developer" else message


def generate_call(inference: Any, req: GenerateRequest, specs: list[dict] | None = None,
                  adapter: str | None = None) -> Call:
    """Seed 001's native body: an optional system prompt and one user prompt."""
    if not req.prompt.strip():
        raise PromptError("is an empty string")
    messages = ([{"role": "system", "content": req.system}] if req.system is not None else []) + \
        [{"role": "user", "content": req.prompt}]
    max_tokens = inference.rollout_config.response_length if req.max_tokens is None else req.max_tokens
    request = inference.prepare([messages], cartridge=specs, progress=False, **_adapter(adapter),
                                **_sampling(req, max_tokens, False))
    return Call(request, req.model, chat=True)


def _adapter(adapter: str | None) -> dict:
    """The `model` field's LoRA adapter as prepare()'s keyword (none for the base model)."""
    return {"adapter": adapter} if adapter is not None else {}


def _call(request: Request, req: Any, *, chat: bool, logprobs: bool, top: int = 0, echo: bool = False) -> Call:
    include = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    return Call(request, req.model, chat, logprobs, top, echo, req.logprobs_in_fingerprint, bool(req.stream),
                include)


def _top_count(inference: Any, k: int | None, field: str) -> int:
    """OpenAI's count of alternatives per token, checked against limits.max_top_logprobs (named as sent)."""
    if k is None:
        return 0
    if k < 0:
        raise SamplingError("must be >= 0", field)
    limit = inference.rules.limits.max_top_logprobs
    if k > limit:
        raise SamplingError(f"{k} exceeds the server's limits.max_top_logprobs={limit}", field)
    return k


def _flatten_content(message: dict, j: int) -> dict:
    """OpenAI content parts -> a string, as Tokasaurus does: exactly one part, of type text."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    if len(content) != 1 or not isinstance(content[0], dict) or content[0].get("type") != "text" \
            or not isinstance(content[0].get("text"), str):
        raise PromptError(f"message {j}: content parts must be exactly one {{'type': 'text', 'text': ...}}")
    return {**message, "content": content[0]["text"]}


def _sampling(req: Any, max_tokens: int, logprobs: bool) -> dict[str, Any]:
    """OpenAI/Tokasaurus fields -> generate()'s keywords (checked by final.request.prepare)."""
    if getattr(req, "logit_bias", None):
        raise SamplingError("is not supported", "logit_bias")
    out: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 0.0 if req.temperature is None else req.temperature,  # Tokasaurus: None means greedy
        "stop": req.stop or None,
        "n": 1 if getattr(req, "n", None) is None else req.n,
        "logprobs": logprobs,
    }
    for key in _SAMPLING:
        if getattr(req, key, None) is not None:
            out[key] = getattr(req, key)
    for key in ("presence_penalty", "frequency_penalty"):  # OpenAI's 0 defaults: leave them to the backend
        if out.get(key) == 0:
            del out[key]
    if out["temperature"] == 0 and "seed" in out:  # a greedy row draws nothing: its seed means nothing (lm-eval
        check_params({"seed": out.pop("seed")})     # sends one always, which sglang would refuse); a bad one is still bad
    if getattr(req, "ignore_eos", False):
        out["ignore_eos"] = True
    for key in CONSTRAINT_KEYS:  # SGLang's extra body fields (json_schema on completions; regex and ebnf on both)
        if getattr(req, key, None) is not None:
            out[key] = getattr(req, key)
    return out


# Tokasaurus' (geoff/cartridges, server/utils.py process_request) cartridge block in a system message. Whatever
# stands between the tags is the block, so an empty one or one holding a list is refused, not left in the text.
CARTRIDGE_BLOCK = re.compile(r"<cartridge>(.*?)</cartridge>", re.DOTALL)


def system_cartridges(req: Any) -> Any:
    """A chat body whose system messages hold `<cartridge>{"id": ..., "source": ...}</cartridge>` blocks, as
    Tokasaurus' branch reads them on every chat route: the blocks become the request's cartridges and leave the
    message (blank lines squeezed as it does). Unlike Tokasaurus, a bad block (empty, not one JSON object, a
    wrong field or a name final.protocol.cartridge_spec refuses) is a 400 (it skips it with a warning), a system
    message left empty is dropped (the cartridge stands for the document's system turn), and blocks together with
    a `cartridges` field are refused (it would drop the field's)."""
    if not isinstance(req, ChatCompletionRequest):
        return req
    found: list[Cartridge] = []
    messages = []
    for j, message in enumerate(req.messages):
        message = _flatten_content(message, j) if message.get("role") == "system" else message
        content = message.get("content")
        if message.get("role") != "system" or not isinstance(content, str) or "<cartridge>" not in content:
            messages.append(message)
            continue
        found.extend(_block_cartridge(block, f"messages[{j}].content") for block in CARTRIDGE_BLOCK.findall(content))
        cleaned = re.sub(r"\n\s*\n\s*\n", "\n\n", CARTRIDGE_BLOCK.sub("", content).strip())
        if cleaned:
            messages.append({**message, "content": cleaned})
    if not found:
        return req
    if getattr(req, "cartridges", None):
        raise CartridgeError("give cartridges in the body or in <cartridge> blocks of a system message, not both",
                             field="cartridges")
    if not messages:
        raise PromptError("messages holds only the <cartridge> block; add the conversation")
    return CartridgeChatCompletionRequest.model_construct(**{**dict(req), "messages": messages, "cartridges": found})


def _block_cartridge(block: str, field: str) -> Cartridge:
    """One <cartridge> block: a JSON object of the wire's Cartridge fields whose names pass the one name check."""
    text = block.strip()
    if not text.startswith("{"):
        raise CartridgeError(f"<cartridge> block {shown(text)} must hold one JSON object "
                             '{"id": ..., "source": ...}', field=field)
    try:
        cart = Cartridge.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        raise CartridgeError(f"<cartridge> block {shown(text, 80)}: {first['msg']}", field=field) from None
    check_cartridge_spec(cart.model_dump(exclude_none=True), field, REQUEST_CARTRIDGE_KEYS, request=True)
    return cart


def cartridge_specs(req: Any, loaded: list[str] | None, cartridge_dir: Path | None,
                    sources: tuple[str, ...] = ("local",)) -> list[dict | str] | None:
    """The request's cartridges as specs to load. HTTP clients may load local files only from --cartridge-dir,
    so a request never reads an arbitrary path: a local file's spec gets its resolved path under that folder (a
    file, a folder, or Tokasaurus' folder <sanitized id>/ with cartridge.pt). Remote sources download with the
    server's credentials: only those in `sources` (--cartridge-sources) are allowed.
    Ids already loaded (the config's cartridges) are served by id, never from a file: had the spec gone on
    without a path, a cartridge evicted between this check and the load would be read from the id as a path.
    loaded=None: this server holds no cartridges (InferenceEngine refuses the specs)."""
    specs: list[dict | str] = []
    for i, spec in enumerate(getattr(req, "cartridges", None) or []):
        # every name is checked before it meets the filesystem: a NUL or a 5,000-character id is a 400, not a 500
        out = check_cartridge_spec(spec.model_dump(exclude_none=True), f"cartridges[{i}]", REQUEST_CARTRIDGE_KEYS,
                                   request=True)
        if loaded is not None and spec.source != "local":
            if spec.id in loaded and not spec.force_redownload:
                out = spec.id  # resident: no download, whichever sources are allowed
            elif spec.source not in sources:
                raise _disabled(spec, sources, f"this server does not download cartridges from {spec.source}")
        elif loaded is not None and "local" not in sources:
            raise _disabled(spec, sources, "this server loads no local cartridge files")
        elif loaded is not None:
            path = _local_under(cartridge_dir, spec.id, f"cartridges[{i}].id")
            if path is not None:
                out["path"] = str(path)  # resident: served from memory; evicted meanwhile: reloaded from here
            elif spec.id in loaded and not spec.force_redownload:
                out = spec.id
            elif cartridge_dir is None:
                raise CartridgeError("loading local cartridge files over HTTP is off; start the server with "
                                     "--cartridge-dir DIR to allow files under DIR", file=spec.id, field="source")
            else:
                raise CartridgeError("is outside the server's --cartridge-dir", file=spec.id,
                                     field="id")
        specs.append(out)
    return specs or None


def _disabled(spec: Cartridge, sources: tuple[str, ...], what: str) -> CartridgeSourceError:
    flags = ",".join(dict.fromkeys({"huggingface": "hf"}.get(s, s) for s in (*sources, spec.source)))
    return CartridgeSourceError(f"{what}; start it with --cartridge-sources {flags} (config key cartridge_sources)",
                                file=spec.id, source=spec.source, reason="disabled")


def _local_under(folder: Path | None, name: str, field: str = "id") -> Path | None:
    """A local id under --cartridge-dir: the file or folder it names, else Tokasaurus' folder for it
    (./cartridges/<sanitized id>/). A folder's cartridge file (cartridge.pt, cache_last.pt...) must resolve
    inside the folder too, so a symlink in it cannot lead out. A lookup the OS refuses (a folder on the way the
    server may not read; a symlink loop, which pathlib raises as RuntimeError) is the client's CartridgeError
    naming `field`, not a 500."""
    try:
        path = _under(folder, name)
        toka_name = sanitize_cartridge_id(name)  # slashes become '-': a long id may make a name no folder can have
        if path is not None and not path.exists() and len(toka_name.encode()) <= MAX_PART_BYTES:
            toka = _under(folder, toka_name)
            path = toka if toka is not None and toka.is_dir() else path
        if path is not None and path.is_dir():
            inner = folder_file(path)
            return _under(folder, str(inner)) if inner is not None else path
        return path
    except (OSError, RuntimeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise CartridgeError(f"cannot be looked up under --cartridge-dir: {why}", file=shown(name),
                             field=field) from None


def _under(folder: Path | None, name: str) -> Path | None:
    """`name` resolved under `folder` (symlinks followed), or None when there is no folder or it leads out."""
    if folder is None:
        return None
    path = Path(name).expanduser()
    resolved = (path if path.is_absolute() else folder / path).resolve()
    return resolved if resolved.is_relative_to(folder) else None
