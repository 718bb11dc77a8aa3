"""The eval's generation backend: LocalRollout (the embedded engine) on veRL's multi-turn path.

`local_backend(...)` builds a LocalRollout with multi_turn.enable (with or without tools; with no tools a
conversation is one assistant turn) and returns a `Generate` function: messages per problem (+ tools_kwargs) ->
ConversationRow per problem. Prompts are built by final.prompts exactly as InferenceEngine builds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from final.rollout.multi_turn import TRACE_KEY
from final.tools.outputs import ConversationRow, conversation_rows


@dataclass
class Backend:
    generate: Callable[[list[list[dict]], "list[dict] | None"], list[ConversationRow]]
    tokenizer: Any
    tool_schemas: list[dict]
    close: Callable[[], None]


def local_backend(model: str, tools_path: str | None, prompt_length: int = 1024, response_length: int = 512,
                  temperature: float = 0.0, max_assistant_turns: int | None = None) -> Backend:
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig, RolloutConfig

    from final.models import model_eos_token_ids, resolve_model_path
    from final.rollout.local import LocalRollout

    path = resolve_model_path(model)
    config = omega_conf_to_dataclass({
        "name": "local", "tensor_model_parallel_size": 1, "load_format": "auto", "skip_tokenizer_init": True,
        "dtype": "auto", "prompt_length": prompt_length, "response_length": response_length,
        "temperature": temperature,
        # the tokenization sanity check only logs template diffs (outputs are unchanged): skip its extra work
        "multi_turn": {"enable": True, "tool_config_path": tools_path, "max_assistant_turns": max_assistant_turns,
                       "tokenization_sanity_check_mode": "disable"},
    }, dataclass_type=RolloutConfig)
    rollout = LocalRollout(config, HFModelConfig(path=path))
    tokenizer = getattr(rollout.processing_class, "tokenizer", rollout.processing_class)
    eos = sorted(set(model_eos_token_ids(path)) | {tokenizer.eos_token_id})
    generate = make_generate(rollout, tokenizer, eos, prompt_length, do_sample=temperature > 0)
    return Backend(generate, tokenizer, rollout.multi_turn.tools.schemas(), rollout.shutdown)


def make_generate(rollout: Any, tokenizer: Any, eos_token_ids: list[int], prompt_length: int,
                  do_sample: bool) -> Callable[[list[list[dict]], "list[dict] | None"], list[ConversationRow]]:
    """messages (+ tools_kwargs) per problem -> one DataProto through `rollout` -> ConversationRow per problem."""
    from final.prompts import build_dataproto, normalize_prompts, tokenize

    def generate(messages: list[list[dict]], tools_kwargs: list[dict] | None) -> list[ConversationRow]:
        items = normalize_prompts(messages)
        ids = tokenize(items, tokenizer, prompt_length)
        data = build_dataproto(ids, items, rollout.pad_token_id, eos_token_ids,
                               meta_info={"do_sample": do_sample, TRACE_KEY: True},
                               non_tensor={"tools_kwargs": tools_kwargs} if tools_kwargs is not None else None)
        return conversation_rows(rollout.generate_sequences(data), tokenizer)

    return generate
