"""veRL 0.6.0's multi-turn batch plumbing: padding requests and the output DataProto.

Each function mirrors a named piece of verl/workers/rollout/sglang_rollout/sglang_rollout.py line for line, so
LocalRollout's multi-turn output is tensor-for-tensor what SGLangRollout returns for the same requests.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from verl import DataProto
from verl.utils.torch_functional import pad_sequence_to_length
from verl.workers.rollout.schemas import AsyncRolloutRequest, AsyncRolloutRequestStateEnum

from final.rollout.batch import sequence_batch

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
            tokenizer: Any, max_model_len: int) -> DataProto:
    """The tail of SGLangRollout._req_level_generate_sequences: finished requests -> padded DataProto."""
    rows = _gather(reqs, config, device, tokenizer, max_model_len)
    prompt_len, response_len = config.prompt_length, config.response_length

    def left(key: str, value: int, length: int) -> torch.Tensor:
        out = pad_sequence(rows[key], batch_first=True, padding_value=value, padding_side="left")
        return pad_sequence_to_length(out, length, value, left_pad=True) if out.shape[-1] < length else out

    def right(key: str, value: int, length: int) -> torch.Tensor:
        out = pad_sequence(rows[key], batch_first=True, padding_value=value)
        return pad_sequence_to_length(out, length, value) if out.shape[-1] < length else out

    responses = right("r", pad_token_id, response_len)
    batch = sequence_batch(left("p", pad_token_id, prompt_len), responses,
                           (left("pa", 0, prompt_len), right("ra", 0, response_len)),
                           (left("pp", 0, prompt_len), right("rp", 0, response_len)),
                           response_mask=right("rl", 0, response_len))
    if config.calculate_log_probs:
        logprobs = pad_sequence(rows["lp"], padding_value=0.0, batch_first=True)
        batch["rollout_log_probs"] = pad_sequence_to_length(logprobs, pad_token_id=0.0,
                                                            max_seq_len=responses.shape[-1]).to(device)
        tokens = pad_sequence(rows["ot"], padding_value=pad_token_id, batch_first=True)
        batch["rollout_output_token_ids"] = pad_sequence_to_length(tokens, pad_token_id=pad_token_id,
                                                                   max_seq_len=responses.shape[-1]).to(device)
    non_tensor_batch = {
        "messages": np.array([{"messages": req.messages} for req in reqs]),
        "reward_scores": np.array([req.reward_scores for req in reqs]),
        "request_id": np.array([req.request_id for req in reqs]),
    }
    return DataProto(batch=batch, non_tensor_batch=non_tensor_batch)


def _gather(reqs: list[AsyncRolloutRequest], config: Any, device: torch.device, tokenizer: Any,
            max_model_len: int) -> dict[str, list[torch.Tensor]]:
    """Each finished request's 1-D tensors, by short name (p: prompt ids, r: response ids, pa/ra: masks, ...)."""
    rows: dict[str, list] = {k: [] for k in ("p", "r", "pa", "ra", "pp", "rp", "rl", "lp", "ot")}
    for req in reqs:
        assert req.state == AsyncRolloutRequestStateEnum.COMPLETED, f"Request {req.request_id} is not completed"
        assert req.input_ids.shape[-1] <= max_model_len, (
            f"request {req.request_id}: {req.input_ids.shape[-1]} tokens exceed max_model_len {max_model_len}:"
            f" {tokenizer.decode(req.input_ids.squeeze(0))!r}")
        for key, tensor in (("p", req.prompt_ids), ("r", req.response_ids), ("pa", req.prompt_attention_mask),
                            ("ra", req.response_attention_mask), ("pp", req.prompt_position_ids),
                            ("rp", req.response_position_ids), ("rl", req.response_loss_mask)):
            rows[key].append(tensor.to(device).squeeze(0))
        if config.calculate_log_probs:
            # veRL slices with len() of a [1, L] tensor, i.e. keeps only the last logprob; kept as is so that
            # rollout_log_probs match SGLangRollout's bit for bit.
            rows["lp"].append(req.rollout_log_probs[-len(req.response_ids):])
            rows["ot"].append(req.output_token_ids[-len(req.response_ids):])
    return rows
