"""DP: throughput of one engine vs a pool of replicas (final.pool) on the same work, side by side.

Reference: what a user runs without the pool -- one InferenceEngine in this process with all its threads (on CUDA,
a pool of one replica, so that it gets a GPU of its own and the pool's replicas do not share it).
Ours: a ReplicaPool of `replicas` Ray actors, each its own engine (an equal share of the CPUs, or one GPU each).
The same chat prompts, greedy, every row exactly new_tokens tokens (ignore_eos); the two alternate and each figure
is a median. On a CPU the replicas share the cores the single engine had to itself, so the ratio measures how
well the cores are used, not more hardware; on a GPU machine each replica brings its own GPU.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from final.bench.throughput import chat_prompts
from final.bench.timing import side_by_side
from final.pool import ReplicaPool


def run_dp(model: str, prompts: int, new_tokens: int, repeats: int, replicas: int = 2,
           device: str = "cpu") -> dict:
    from transformers import AutoTokenizer

    from final.inf import InferenceEngine

    config = {"model_path": model, "progress": False,
              "rollout": {"name": "local", "prompt_length": 256, "response_length": new_tokens,
                          "max_num_seqs": max(prompts, 1), "calculate_log_probs": False,
                          "engine_kwargs": {"local": {"device": device}}}}
    work: list[Any] = chat_prompts(AutoTokenizer.from_pretrained(model), prompts)  # token ids: no template drift
    args = dict(temperature=0, ignore_eos=True, max_tokens=new_tokens)
    single = ReplicaPool(config, replicas=1) if device == "cuda" else InferenceEngine(config)
    try:
        with ReplicaPool(config, replicas=replicas) as pool:
            outs: dict[str, Any] = {}
            pair = side_by_side(lambda: outs.__setitem__("one", single.generate(work, **args)),
                                lambda: outs.__setitem__("pool", pool.generate(work, **args)), repeats)
            info = pool.info
    finally:
        single.shutdown()
    # ignore_eos: every row decodes new_tokens (what is timed); the returned text stops at the first EOS (veRL's mask)
    tokens = prompts * new_tokens
    same = sum(a == b for a, b in zip(outs["one"].token_ids, outs["pool"].token_ids))
    one_tok_s, pool_tok_s = tokens / pair.reference_s, tokens / pair.ours_s
    return {"ours": round(pool_tok_s, 2), "reference": round(one_tok_s, 2), "ratio": round(pool_tok_s / one_tok_s, 3),
            "unit": "tok/s", "replicas": replicas, "prompts": prompts, "new_tokens": new_tokens, "tokens": tokens,
            "same_tokens": f"{same}/{prompts}", "ours_s": round(pair.ours_s, 3),
            "reference_s": round(pair.reference_s, 3),
            "rows_per_replica": dict(sorted(Counter(m["replica"] for m in outs["pool"].metadata).items())),
            "replica_threads": [i["threads"] for i in info], "replica_gpus": [i["gpus"] for i in info],
            "note": ("each replica has its own GPU" if device == "cuda" else
                     f"{replicas} replicas share this machine's cores with each other (the single engine had "
                     "them all): on a CPU this measures core use, not added hardware")}


def describe(d: dict) -> str:
    """One line for the table."""
    return (f"{d['prompts']} prompts x {d['new_tokens']} tokens: 1 engine {d['reference']:.1f} tok/s, "
            f"{d['replicas']} replicas {d['ours']:.1f} tok/s -> {d['ratio']:.2f}x; rows per replica "
            f"{d['rows_per_replica']}, same greedy tokens {d['same_tokens']}")
