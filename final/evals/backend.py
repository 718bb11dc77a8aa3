"""The eval's generation backend: the embedded engine behind veRL's multi-turn rollout contract.

`local_backend(...)` builds an EmbeddedEngine and a MultiTurnRollout (multi_turn.enable with or without tools; with
no tools a conversation is one assistant turn) and returns a `Generate` function: messages per problem (+ tools_kwargs)
-> ConversationRow per problem. Prompts go in as veRL's RL dataset hands them over: a left-padded DataProto with
`raw_prompt` and `tools_kwargs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from verl import DataProto

from final.rollout.multi_turn import TRACE_KEY, MultiTurnRollout
from final.tools.outputs import ConversationRow, conversation_rows


@dataclass
class Backend:
    generate: Callable[[list[list[dict]], "list[dict] | None"], list[ConversationRow]]
    tokenizer: Any
    tool_schemas: list[dict]
    close: Callable[[], None]


def local_backend(model: str, tools_path: str | None, prompt_length: int = 1024, response_length: int = 512,
                  temperature: float = 0.0, max_assistant_turns: int | None = None) -> Backend:
    from transformers import AutoTokenizer
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    from final.engine.engine import EmbeddedEngine
    from final.models import resolve_model_path

    path = resolve_model_path(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = omega_conf_to_dataclass({
        "name": "local", "tensor_model_parallel_size": 1, "load_format": "auto", "skip_tokenizer_init": True,
        "prompt_length": prompt_length, "response_length": response_length, "temperature": temperature,
        # the tokenization sanity check only logs template diffs (outputs are unchanged): skip its extra work
        "multi_turn": {"enable": True, "tool_config_path": tools_path, "max_assistant_turns": max_assistant_turns,
                       "tokenization_sanity_check_mode": "disable"},
    }, dataclass_type=RolloutConfig)
    engine = EmbeddedEngine(path)
    try:
        rollout = MultiTurnRollout(engine, config, tokenizer)
    except Exception:
        engine.shutdown()
        raise

    def generate(messages: list[list[dict]], tools_kwargs: list[dict] | None) -> list[ConversationRow]:
        batch = prompt_batch(tokenizer, messages, tools_kwargs, prompt_length, do_sample=temperature > 0)
        return conversation_rows(rollout.generate_sequences(batch), tokenizer)

    return Backend(generate, tokenizer, rollout.tools.schemas(), engine.shutdown)


def prompt_batch(tokenizer: Any, messages: list[list[dict]], tools_kwargs: list[dict] | None, width: int,
                  do_sample: bool) -> DataProto:
    rows = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in messages]
    width = max(width, max(len(r) for r in rows))
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, ids in enumerate(rows):
        input_ids[i, width - len(ids):] = torch.tensor(ids)
        attention_mask[i, width - len(ids):] = 1
    non_tensors = {"raw_prompt": _objects(messages)}
    if tools_kwargs is not None:
        non_tensors["tools_kwargs"] = _objects(tools_kwargs)
    return DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask,
                 "position_ids": torch.clamp(attention_mask.cumsum(-1) - 1, min=0)},
        non_tensors=non_tensors,
        meta_info={"eos_token_id": tokenizer.eos_token_id, "do_sample": do_sample,
                   TRACE_KEY: True})


def _objects(items: list) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    return arr
