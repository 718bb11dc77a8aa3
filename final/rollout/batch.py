"""veRL 0.6.0 SGLangRollout's batch path without SGLang: sampling params in, DataProto out.

The engine rollouts (local, tokasaurus) plan their engine requests and build their output DataProto here, so they
produce exactly what `SGLangRollout._batch_level_generate_sequences` produces (keys, shapes, dtypes, padding
values — including veRL's padding of rollout_log_probs with pad_token_id).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from final.errors import PromptError
from final.outputs import PROMPT_LOGPROBS, ROW_INFO, SINGLE_TURN, TOP_LOGPROBS, row_infos
from final.prompts import object_array
from final.sampling import row_seed

# Attributes of SGLang 0.5.2's SamplingParams() (sglang/srt/sampling/sampling_params.py). veRL copies every
# RolloutConfig key that is one of these (or contains "stop") into the request's sampling params.
SGLANG_SAMPLING_ATTRS = frozenset({
    "max_new_tokens", "stop_strs", "stop_token_ids", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "min_new_tokens", "regex", "n", "json_schema", "ebnf",
    "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "custom_params", "stream_interval", "logit_bias", "verify", "normalize",
})

GREEDY_OVERRIDES = {
    "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "temperature": 0,
    "top_p": 1, "top_k": -1, "ignore_eos": False, "min_new_tokens": 0, "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
}


def base_sampling_params(config) -> dict[str, Any]:
    """SGLangRollout._init_sampling_params."""
    params = dict(n=1, max_new_tokens=config.response_length, presence_penalty=0.0, frequency_penalty=0.0,
                  repetition_penalty=config.get("repetition_penalty", 1.0))
    for key in config.keys():
        if key in SGLANG_SAMPLING_ATTRS or "stop" in str(key):
            params[key] = config.get(key)
    params["n"] = 1
    return params


def request_sampling_params(base: dict, config, meta_info: dict, kwargs: dict) -> dict[str, Any]:
    """The per-call sampling params of SGLangRollout (greedy when do_sample is False, val_kwargs when validating)."""
    params = dict(base)
    if not meta_info.get("do_sample", True):
        params.update(GREEDY_OVERRIDES, max_new_tokens=config.response_length)
    elif meta_info.get("validate", False):
        params.update(top_k=config.val_kwargs.top_k, top_p=config.val_kwargs.top_p,
                      temperature=config.val_kwargs.temperature, n=1)
    params.update(kwargs)
    return params


def prompt_token_lists(prompts, pad_token_id: int) -> list[list[int]]:
    """raw_prompt_ids when given, else the left padding stripped as veRL's _pre_process_inputs does."""
    if "multi_modal_data" in prompts.non_tensor_batch:
        raise PromptError("multi-modal prompts are not supported by this backend")
    if "raw_prompt_ids" in prompts.non_tensor_batch:
        return [list(map(int, ids)) for ids in prompts.non_tensor_batch["raw_prompt_ids"]]
    return [strip_left(row, pad_token_id).tolist() for row in prompts.batch["input_ids"]]


def strip_left(row: torch.Tensor, pad: int) -> torch.Tensor:
    """veRL's _pre_process_inputs: one row without its left padding."""
    return row[int(torch.nonzero(row != pad, as_tuple=False)[0][0]):]


def sequence_batch(prompts: torch.Tensor, responses: torch.Tensor, attention: tuple[torch.Tensor, torch.Tensor],
                   positions: tuple[torch.Tensor, torch.Tensor], **extra: torch.Tensor):
    """The TensorDict both veRL paths return: prompts, responses, and input_ids / attention_mask / position_ids
    as prompt and response halves side by side (plus the path's own tensors, e.g. response_mask)."""
    from tensordict import TensorDict

    return TensorDict({
        "prompts": prompts, "responses": responses, **extra,
        "input_ids": torch.cat((prompts, responses), dim=-1),
        "attention_mask": torch.cat(attention, dim=-1),
        "position_ids": torch.cat(positions, dim=-1),
    }, batch_size=prompts.size(0))


def pad_token_id(tokenizer) -> int:
    """The pad id every backend uses: the tokenizer's, else its eos (as veRL's HFModelConfig falls back)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


@dataclass
class Rows:
    """A batch-path call's engine requests: token ids, sampling params, cartridge ids and adapter, one of each per
    row."""

    ids: list[list[int]]
    params: list[dict[str, Any]]
    cartridges: list[tuple[str, ...]] | None  # None: the call names none (a backend may add its defaults)
    adapters: list[str | None] | None = None  # LoRA adapter names (None: the base), from non_tensor["adapters"]


def plan_rows(prompts, base: dict, config, kwargs: dict, pad: int) -> Rows:
    """The engine requests of SGLangRollout's batch path, one per row, each with its own seed (row i of a call
    samples with seed + i: reproducible, and rows repeated for n > 1 still differ)."""
    ids = prompt_token_lists(prompts, pad)
    params = request_sampling_params(base, config, prompts.meta_info, kwargs)
    seed = params.pop("seed", None)
    per_row = [dict(params, seed=row_seed(seed, i)) if seed is not None else params for i in range(len(ids))]
    adapters = prompts.non_tensor_batch.get("adapters")
    return Rows(ids, per_row, row_cartridges(prompts), None if adapters is None else list(adapters))


def logprob_request(prompts) -> dict[str, int]:
    """The engine arguments (SGLang's) a call's meta_info asks for beyond veRL's: every prompt token's logprob
    (logprob_start_len=0) and k alternatives per position (top_logprobs_num). Empty for a plain veRL call."""
    meta = prompts.meta_info
    args = {"logprob_start_len": 0} if meta.get(PROMPT_LOGPROBS) else {}
    if meta.get(TOP_LOGPROBS):
        args["top_logprobs_num"] = int(meta[TOP_LOGPROBS])
    return args


def single_turn(prompts) -> bool:
    """A call that takes the batch path (one engine request per row) even where multi-turn is on: scoring / top-k
    (logprob_request) and a call whose tools are only offered (final.outputs.SINGLE_TURN)."""
    return bool(logprob_request(prompts)) or bool(prompts.meta_info.get(SINGLE_TURN))


def row_cartridges(prompts) -> list[tuple[str, ...]] | None:
    """The per-row cartridge ids carried in non_tensor_batch["cartridges"] (None when absent)."""
    values = prompts.non_tensor_batch.get("cartridges")
    if values is None:
        return None
    return [tuple(v) if v is not None else () for v in values]


def assemble_batch(prompts, outputs: list[dict], config, pad_token_id: int):
    """Engine outputs (SGLang dicts) -> SGLangRollout's batch-path DataProto. The input is not modified."""
    from verl import DataProto
    from verl.utils.torch_functional import get_response_mask, pad_sequence_to_length

    idx = prompts.batch["input_ids"]
    attention_mask = prompts.batch["attention_mask"]
    position_ids = prompts.batch["position_ids"]
    eos_token_id = prompts.meta_info["eos_token_id"]
    batch_size = idx.size(0)
    if len(outputs) != batch_size:
        raise ValueError(f"{len(outputs)} engine outputs for {batch_size} prompts (n must be 1 per row)")

    ids, logprobs = [], []
    for out in outputs:
        pairs = out["meta_info"]["output_token_logprobs"]
        logprobs.append(torch.tensor([lp for lp, _, _ in pairs], dtype=torch.float32))
        ids.append(torch.tensor([tok for _, tok, _ in pairs], dtype=torch.long))  # typed: a scoring row may be empty
    response = pad_sequence(ids, batch_first=True, padding_value=pad_token_id).to(idx.device)
    rollout_log_probs = pad_sequence(logprobs, batch_first=True, padding_value=pad_token_id).to(idx.device)
    if response.shape[1] < config.response_length:
        response = pad_sequence_to_length(response, config.response_length, pad_token_id)
        rollout_log_probs = pad_sequence_to_length(rollout_log_probs, config.response_length, pad_token_id)

    delta = torch.arange(1, response.size(1) + 1, device=position_ids.device).unsqueeze(0).repeat(batch_size, 1)
    response_attention_mask = get_response_mask(response_id=response, eos_token=eos_token_id,
                                                dtype=attention_mask.dtype)
    batch = sequence_batch(idx, response, (attention_mask, response_attention_mask),
                           (position_ids, position_ids[..., -1:] + delta))
    if config.calculate_log_probs:
        batch["rollout_log_probs"] = rollout_log_probs
    non_tensor = {k: v for k, v in prompts.non_tensor_batch.items() if k != "raw_prompt_ids"}
    if prompts.meta_info.get(ROW_INFO):  # each row's engine record, for InferenceEngine and the server
        non_tensor[ROW_INFO] = object_array(row_infos(outputs, bool(prompts.meta_info.get(PROMPT_LOGPROBS))))
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info={})
