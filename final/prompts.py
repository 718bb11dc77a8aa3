"""Prompts in, DataProto out, and back: the text side of veRL's rollout contract.

Accepted prompt shapes (one prompt or a batch):
  "text"                               -> one chat turn [{"role": "user", "content": "text"}]
  [{"role": ..., "content": ...}, ...] -> one conversation
  [101, 102, 103]                      -> one prompt as token ids (sent as is)
  a list of any of the above           -> a batch
With raw=True, strings are tokenized as plain text instead of wrapped in the chat template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from final.chat_template import ChatOptions, render_chat
from final.compat import chat_ids
from final.errors import CartridgeError, PromptError

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Prompt:
    messages: list[dict] | None = None
    text: str | None = None
    ids: list[int] | None = None


def is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _is_conversation(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(m, dict) for m in x)


def prompt_items(prompts: Any) -> list:
    """One prompt or a batch -> the list of prompts, each still in its accepted shape (not validated)."""
    if isinstance(prompts, (str, dict)) or is_ids(prompts) or _is_conversation(prompts):
        items = [prompts]
    elif isinstance(prompts, (list, tuple)):
        items = list(prompts)
    else:
        raise PromptError(f"prompts must be a string, a message list, token ids or a list of those, "
                          f"got {type(prompts).__name__}")
    if not items:
        raise PromptError("the prompt list is empty")
    return items


def normalize_prompts(prompts: Any, raw: bool = False) -> list[Prompt]:
    """Any accepted shape -> a list of Prompt, validating as we go (PromptError names the index)."""
    return [_normalize_one(item, i, raw) for i, item in enumerate(prompt_items(prompts))]


def _normalize_one(item: Any, index: int, raw: bool) -> Prompt:
    if isinstance(item, str):
        if not item.strip():
            raise PromptError("is an empty string", index)
        return Prompt(text=item) if raw else Prompt(messages=[{"role": "user", "content": item}])
    if isinstance(item, dict):
        item = [item]
    if is_ids(item):
        if any(t < 0 for t in item):
            raise PromptError("token ids must be >= 0", index)
        return Prompt(ids=list(item))
    if _is_conversation(item):
        return Prompt(messages=[_check_message(m, index, j) for j, m in enumerate(item)])
    if isinstance(item, list) and not item:
        raise PromptError("is an empty list", index)
    raise PromptError(f"must be a string, a list of messages or a list of token ids, got {type(item).__name__}", index)


def _check_message(message: dict, index: int, j: int) -> dict:
    role = message.get("role")
    if role is None:
        raise PromptError(f"message {j} has no 'role'", index)
    if role not in ROLES:
        raise PromptError(f"message {j} has unknown role {role!r}; expected one of {', '.join(ROLES)}", index)
    calls = message.get("tool_calls")
    if calls is not None:
        _check_tool_calls(calls, role, index, j)
    if "content" not in message and not calls:
        raise PromptError(f"message {j} has no 'content'", index)
    content = message.get("content")
    if content is None and not calls:
        raise PromptError(f"message {j} has content None and no tool_calls", index)
    if content is not None and not isinstance(content, str):
        raise PromptError(f"message {j} content must be a string, got {type(content).__name__}", index)
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None and not isinstance(message[key], str):
            raise PromptError(f"message {j} {key} must be a string, got {type(message[key]).__name__}", index)
    return dict(message)


def _check_tool_calls(calls: Any, role: str, index: int, j: int) -> None:
    """An assistant message's OpenAI tool_calls: [{id, type: "function", function: {name, arguments}}]."""
    where = f"message {j} tool_calls"
    if role != "assistant":
        raise PromptError(f"message {j}: only assistant messages carry tool_calls, not {role!r}", index)
    if not isinstance(calls, list):
        raise PromptError(f"{where} must be a list, got {type(calls).__name__}", index)
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise PromptError(f"{where}[{k}] must be an object with a 'function' object", index)
        if call.get("type", "function") != "function":
            raise PromptError(f"{where}[{k}].type must be 'function', got {call.get('type')!r:.40}", index)
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise PromptError(f"{where}[{k}].id must be a string", index)
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise PromptError(f"{where}[{k}].function.name must be a non-empty string", index)
        arguments = fn.get("arguments")
        if arguments is not None and not isinstance(arguments, (str, dict)):
            raise PromptError(f"{where}[{k}].function.arguments must be a JSON string or an object, got "
                              f"{type(arguments).__name__}", index)


def tokenize(prompts: list[Prompt], tokenizer, prompt_length: int,
             after_cartridge: Sequence[bool] | None = None, chat: ChatOptions | None = None) -> list[list[int]]:
    """Token ids per prompt (chat template with generation prompt for conversations).

    A prompt that follows a cartridge continues the cartridge's token stream: no BOS, and in chat form the
    conversation after the document's system turn (continuation_ids). Conversations are rendered (final.chat_template:
    the call's tools and template variables, the fallback where the template cannot render them), then encoded in
    one batch: the ids apply_chat_template(tokenize=True) gives, at about half its cost.
    """
    out: list[list[int] | None] = [None] * len(prompts)
    chats = []
    vocab = len(tokenizer) if any(p.ids is not None for p in prompts) else 0  # once: see tokenize_continuations
    for i, p in enumerate(prompts):
        if after_cartridge is not None and after_cartridge[i] and p.ids is None:
            is_chat = p.messages is not None
            out[i] = continuation_ids(tokenizer, p.messages if is_chat else p.text, chat=is_chat)
        elif p.ids is not None:
            if max(p.ids) >= vocab:
                raise PromptError(f"token id {max(p.ids)} is outside the vocabulary of {vocab}", i)
            out[i] = p.ids
        elif p.messages is not None:
            if getattr(tokenizer, "chat_template", None) is None:
                raise PromptError("the tokenizer has no chat template; pass raw=True to send plain text", i)
            chats.append(i)
        else:
            out[i] = tokenizer(p.text)["input_ids"]
    if chats:
        texts = []
        for i in chats:
            try:
                texts.append(render_chat(tokenizer, prompts[i].messages, chat))
            except PromptError as exc:
                raise PromptError(str(exc), i) from None
        for i, ids in zip(chats, tokenizer(texts, add_special_tokens=False)["input_ids"]):
            out[i] = list(ids)
    for i, ids in enumerate(out):
        if len(ids) > prompt_length:
            raise PromptError(f"has {len(ids)} tokens, over rollout.prompt_length={prompt_length}", i)
    return out


def tokenize_continuations(continuations: Any, n_prompts: int, tokenizer: Any, max_tokens: int) -> list[list[int]]:
    """Scoring: one continuation per prompt (text, token ids, or None for none; one prompt may take it bare).
    Text is encoded without special tokens, as lm-eval encodes a continuation: it goes right after the prompt."""
    one = isinstance(continuations, str) or is_ids(continuations)
    items = [continuations] if one and n_prompts == 1 else continuations
    if not isinstance(items, (list, tuple)) or len(items) != n_prompts:
        raise PromptError(f"continuations must be one entry (text, token ids or None) per prompt ({n_prompts})")
    out = []
    vocab = len(tokenizer)  # once: a fast tokenizer's len() asks the Rust side for the vocabulary (~1 ms or more)
    for i, c in enumerate(items):
        if c is None:
            ids = []
        elif isinstance(c, str) and c:
            ids = tokenizer(c, add_special_tokens=False)["input_ids"]
        elif is_ids(c) and all(0 <= t < vocab for t in c):
            ids = list(c)
        else:
            raise PromptError(f"continuation must be non-empty text, token ids in [0, {vocab}) or None, "
                              f"got {c!r:.80}", i)
        if len(ids) > max_tokens:
            raise PromptError(f"continuation has {len(ids)} tokens, over rollout.response_length={max_tokens}", i)
        out.append(ids)
    return out


# ---- the token stream that follows a cartridge ---------------------------------------------------------------
# In chat mode a cartridge's document is a system turn (`<|im_start|>system\n{text}<|im_end|>\n` for ChatML) and
# a question is the rest of the conversation rendered after it, tokenized without special tokens: no second BOS
# follows the cartridge, whose first token is the attention sink.
_PLACEHOLDER = "\x00DOCUMENT\x00"


def _split_chat(tokenizer: Any, messages: list[dict]) -> tuple[str, str]:
    """Render [system: placeholder] + messages and return (system part, the rest)."""
    sys_msg = [{"role": "system", "content": _PLACEHOLDER}]
    head = tokenizer.apply_chat_template(sys_msg, tokenize=False)
    full = tokenizer.apply_chat_template(sys_msg + messages, tokenize=False, add_generation_prompt=True)
    if not full.startswith(head):
        raise CartridgeError("the chat template does not render a system turn as a fixed prefix; use chat=False",
                             field="chat_template")
    return head, full[len(head):]


def document_ids(tokenizer: Any, text: str, chat: bool = True) -> list[int]:
    """The token ids a cartridge of `text` stands for (what would otherwise be prefilled)."""
    if not text.strip():
        raise CartridgeError("document text is empty", field="text")
    if not chat:
        return tokenizer(text).input_ids  # with the tokenizer's BOS, if it adds one
    head, _ = _split_chat(tokenizer, [])
    return tokenizer(head.replace(_PLACEHOLDER, text), add_special_tokens=False).input_ids


def document_text_held(tokenizer: Any, text: str, tokens: int) -> str:
    """The part of `text` that the first `tokens` ids of its chat document_ids hold (the template's head is
    counted; a cut token is left out): what a cartridge of the text's first `tokens` tokens can know."""
    head, _ = _split_chat(tokenizer, [])
    n = tokens - len(tokenizer(head.split(_PLACEHOLDER)[0], add_special_tokens=False).input_ids)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True).offset_mapping
    return text[:offsets[min(n, len(offsets)) - 1][1]] if n > 0 and offsets else ""


def continuation_ids(tokenizer: Any, messages: str | list[dict], chat: bool = True) -> list[int]:
    """Prompt ids that follow a cartridge: the conversation after the document's system turn, no BOS."""
    if not chat:
        if not isinstance(messages, str):
            raise CartridgeError("raw (chat=False) continuations must be text", field="prompt")
        return tokenizer(messages, add_special_tokens=False).input_ids
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    _, rest = _split_chat(tokenizer, messages)
    return tokenizer(rest, add_special_tokens=False).input_ids


def default_system_ids(tokenizer: Any) -> list[int]:
    """The ids a chat template renders before a conversation that has no system turn of its own (its default
    system turn, e.g. SmolLM2's "You are a helpful AI assistant named SmolLM...", and a BOS if the template writes
    one); [] when it renders nothing there. A cartridge stands for the system turn, so what follows a cartridge is
    a rendered conversation without these ids: `after_system_turn(chat_ids(...), default_system_ids(...))` equals
    continuation_ids(...) for a conversation that has no system turn (veRL's agent loop renders the former)."""
    probe = [{"role": "user", "content": "x"}]
    full = chat_ids(tokenizer, probe, add_generation_prompt=True)
    rest = continuation_ids(tokenizer, probe)
    if len(full) < len(rest) or full[len(full) - len(rest):] != rest:
        raise CartridgeError("the chat template does not render a conversation as its default system turn followed "
                             "by what follows a cartridge (continuation_ids)", field="chat_template")
    return full[:len(full) - len(rest)]


def after_system_turn(ids: Sequence[int], system_ids: Sequence[int]) -> list[int]:
    """`ids` without its leading default system turn (default_system_ids); ids that start otherwise (a system
    turn of the conversation's own, which continuation_ids keeps too) are returned as they are."""
    ids = [int(i) for i in ids]
    n = len(system_ids)
    return ids[n:] if n and ids[:n] == list(system_ids) else ids


def build_dataproto(prompt_ids: list[list[int]], prompts: list[Prompt], pad_token_id: int,
                    eos_token_ids: Sequence[int], meta_info: dict | None = None,
                    non_tensor: dict[str, list] | None = None):
    """veRL's rollout input: left-padded input_ids/attention_mask/position_ids to the longest prompt.

    non_tensor_batch carries raw_prompt_ids (exact ids, so no pad-stripping guesswork), raw_prompt (the
    message lists veRL's multi-turn path re-tokenizes) and any per-row extras (cartridges, tools_kwargs).
    """
    from verl import DataProto
    from verl.utils.model import compute_position_id_with_mask

    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids):] = 1
    position_ids = compute_position_id_with_mask(attention_mask)
    non_tensor_batch = {"raw_prompt_ids": object_array([list(ids) for ids in prompt_ids])}
    if all(p.messages is not None for p in prompts):
        non_tensor_batch["raw_prompt"] = object_array([p.messages for p in prompts])
    for key, values in (non_tensor or {}).items():
        non_tensor_batch[key] = object_array(values)
    meta = {"eos_token_id": sorted(set(eos_token_ids)), "pad_token_id": pad_token_id, "do_sample": True,
            "validate": False, **(meta_info or {})}
    return DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
        non_tensors=non_tensor_batch, meta_info=meta)


def object_array(values: list) -> np.ndarray:
    """A 1-D object array (numpy would otherwise turn equal-length lists into a 2-D array)."""
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr
