"""veRL 0.6.0's multi-turn batch plumbing: padding requests and the output DataProto.

Each function mirrors a named piece of verl/workers/rollout/sglang_rollout/sglang_rollout.py line for line, so
LocalRollout's multi-turn output is tensor-for-tensor what SGLangRollout returns for the same requests.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torch.nn.utils.rnn import pad_sequence
from verl import DataProto
from verl.utils.torch_functional import pad_sequence_to_length
from verl.workers.rollout.schemas import AsyncRolloutRequest, AsyncRolloutRequestStateEnum

def padding_request(req: AsyncRolloutRequest, response_length: int, pad_token_id: int) -> AsyncRolloutRequest:
    """SGLangRollout._create_padding_request: stands in for a request cancelled by over-sampling."""
    device = req.input_ids.device if req.input_ids is not None else "cpu"
    zeros = lambda n: torch.zeros((1, n), dtype=torch.long, device=device)  # noqa: E731
    position_ids = None
    if req.position_ids is not None:
        rows = req.position_ids.shape[0] if req.position_ids.dim() == 2 else 1
        position_ids = torch.zeros((rows, response_length), dtype=torch.long, device=device)
    pad = req.model_copy(deep=True)
    pad.state = AsyncRolloutRequestStateEnum.COMPLETED
    pad.response_ids = torch.full((1, response_length), pad_token_id, dtype=torch.long, device=device)
    pad.prompt_attention_mask = zeros(req.prompt_attention_mask.shape[-1])
    pad.response_attention_mask = zeros(response_length)
    pad.response_position_ids = position_ids
    pad.response_loss_mask = zeros(response_length)
    pad.reward_scores = {}
    pad.metrics = {}
    pad.output_token_ids = None
    pad.rollout_log_probs = None
    return pad


def collate(reqs: list[AsyncRolloutRequest], config: Any, pad_token_id: int, device: torch.device,
            tokenizer: Any) -> DataProto:
    """The tail of SGLangRollout._req_level_generate_sequences: finished requests -> padded DataProto."""
    prompt_len, response_len = config.prompt_length, config.response_length
    rows: dict[str, list] = {k: [] for k in ("p", "r", "pa", "ra", "pp", "rp", "rl", "lp", "ot")}
    messages, reward_scores, request_ids = [], [], []
    for req in reqs:
        assert req.state == AsyncRolloutRequestStateEnum.COMPLETED, f"Request {req.request_id} is not completed"
        assert req.input_ids.shape[-1] <= config.max_model_len, (
            f"request {req.request_id}: {req.input_ids.shape[-1]} tokens exceed max_model_len {config.max_model_len}:"
            f" {tokenizer.decode(req.input_ids.squeeze(0))!r}")
        rows["p"].append(req.prompt_ids.to(device).squeeze(0))
        rows["r"].append(req.response_ids.to(device).squeeze(0))
        rows["pa"].append(req.prompt_attention_mask.to(device).squeeze(0))
        rows["ra"].append(req.response_attention_mask.to(device).squeeze(0))
        rows["pp"].append(req.prompt_position_ids.to(device).squeeze(0))
        rows["rp"].append(req.response_position_ids.to(device).squeeze(0))
        rows["rl"].append(req.response_loss_mask.to(device).squeeze(0))
        messages.append({"messages": req.messages})
        reward_scores.append(req.reward_scores)
        request_ids.append(req.request_id)
        if config.calculate_log_probs:
            # veRL slices with len() of a [1, L] tensor, i.e. keeps only the last logprob; kept as is so that
            # rollout_log_probs match SGLangRollout's bit for bit.
            rows["lp"].append(req.rollout_log_probs[-len(req.response_ids):])
            rows["ot"].append(req.output_token_ids[-len(req.response_ids):])

    def left(seqs: list[torch.Tensor], value: int, length: int) -> torch.Tensor:
        out = pad_sequence(seqs, batch_first=True, padding_value=value, padding_side="left")
        return pad_sequence_to_length(out, length, value, left_pad=True) if out.shape[-1] < length else out

    def right(seqs: list[torch.Tensor], value: int, length: int) -> torch.Tensor:
        out = pad_sequence(seqs, batch_first=True, padding_value=value)
        return pad_sequence_to_length(out, length, value) if out.shape[-1] < length else out

    prompt_ids = left(rows["p"], pad_token_id, prompt_len)
    response_ids = right(rows["r"], pad_token_id, response_len)
    prompt_attention_mask = left(rows["pa"], 0, prompt_len)
    response_attention_mask = right(rows["ra"], 0, response_len)
    prompt_position_ids = left(rows["pp"], 0, prompt_len)
    response_position_ids = right(rows["rp"], 0, response_len)
    response_loss_mask = right(rows["rl"], 0, response_len)

    batch = TensorDict({
        "prompts": prompt_ids,
        "responses": response_ids,
        "response_mask": response_loss_mask,
        "input_ids": torch.cat((prompt_ids, response_ids), dim=-1),
        "attention_mask": torch.cat((prompt_attention_mask, response_attention_mask), dim=-1),
        "position_ids": torch.cat((prompt_position_ids, response_position_ids), dim=-1),
    }, batch_size=len(reqs))
    if config.calculate_log_probs:
        logprobs = pad_sequence(rows["lp"], padding_value=0.0, batch_first=True)
        batch["rollout_log_probs"] = pad_sequence_to_length(logprobs, pad_token_id=0.0,
                                                            max_seq_len=response_ids.shape[-1]).to(device)
        tokens = pad_sequence(rows["ot"], padding_value=pad_token_id, batch_first=True)
        batch["rollout_output_token_ids"] = pad_sequence_to_length(tokens, pad_token_id=pad_token_id,
                                                                   max_seq_len=response_ids.shape[-1]).to(device)
    non_tensor_batch = {
        "messages": np.array(messages),
        "reward_scores": np.array(reward_scores),
        "request_id": np.array(request_ids),
    }
    return DataProto(batch=batch, non_tensor_batch=non_tensor_batch)
