"""Tokasaurus' `system_fingerprint` side channel: token ids and logprobs packed into the OpenAI response.

Read from ScalingIntelligence/tokasaurus (branch geoff/cartridges), tokasaurus/server/utils.py
`make_completions_fingerprint`: the fingerprint is a JSON string
    {"completion_ids": [[ids of choice 0], ...],
     "packed_chosen_logprobs": [base64(float32 array) per choice] | null,   # when logprobs_in_fingerprint
     "packed_topk_indices": ..., "packed_topk_logprobs": ...}                 # top-k, null unless requested
Seed 000's veRL rollout reads completion_ids[0] and packed_chosen_logprobs[0] from it; so do we.
"""

from __future__ import annotations

import base64
import json
from typing import Sequence

import numpy as np


def pack_floats(values: Sequence[float]) -> str:
    return base64.b64encode(np.asarray(values, dtype=np.float32).tobytes()).decode("ascii")


def unpack_floats(packed: str) -> list[float]:
    return np.frombuffer(base64.b64decode(packed), dtype=np.float32).tolist()


def make_fingerprint(completion_ids: list[list[int]], logprobs: list[list[float]] | None) -> str:
    """The fingerprint string for a response (logprobs None unless the request set logprobs_in_fingerprint)."""
    return json.dumps({
        "completion_ids": completion_ids,
        "packed_chosen_logprobs": [pack_floats(lp) for lp in logprobs] if logprobs is not None else None,
        "packed_topk_indices": None,
        "packed_topk_logprobs": None,
    })


def read_fingerprint(fingerprint: str | None) -> tuple[list[list[int]], list[list[float]] | None]:
    """(completion ids per choice, chosen logprobs per choice or None) from a Tokasaurus response.

    Raises ValueError when the fingerprint is missing or not Tokasaurus' JSON (e.g. a plain OpenAI server).
    """
    if not fingerprint:
        raise ValueError("the response has no system_fingerprint (is the server Tokasaurus-compatible?)")
    try:
        data = json.loads(fingerprint)
    except json.JSONDecodeError as exc:
        raise ValueError(f"system_fingerprint is not Tokasaurus' JSON: {fingerprint[:80]!r}") from exc
    ids = data.get("completion_ids") if isinstance(data, dict) else None
    if not isinstance(ids, list):
        raise ValueError("system_fingerprint has no completion_ids")
    packed = data.get("packed_chosen_logprobs")
    logprobs = [unpack_floats(p) for p in packed] if packed else None
    return [list(map(int, row)) for row in ids], logprobs
