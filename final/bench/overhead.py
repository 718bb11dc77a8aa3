"""P4: what InferenceEngine adds on top of the rollout it wraps.

Ours: `InferenceEngine.generate(prompts)` (normalize, chat template, DataProto, rollout, decode).
Reference: `rollout.generate_sequences(data)` on a DataProto built beforehand from the same prompts, which is
what a veRL trainer calls. Both generate the same few greedy tokens on the same engine, interleaved, so the
difference divided by the number of prompts is the wrapper's cost per prompt.
"""

from __future__ import annotations

from final.bench.timing import side_by_side
from final.prompts import build_dataproto, normalize_prompts, tokenize


def run_overhead(model: str, prompts: int, new_tokens: int, repeats: int) -> dict:
    from final.inf import InferenceEngine

    config = {"model_path": model, "progress": False,
              "rollout": {"name": "local", "prompt_length": 128, "response_length": max(new_tokens, 1),
                          "max_num_seqs": max(prompts, 1), "calculate_log_probs": False}}
    texts = [f"Question {i}: what is {i} plus {i + 1}?" for i in range(prompts)]
    with InferenceEngine(config) as eng:
        items = normalize_prompts(texts)
        ids = tokenize(items, eng.tokenizer, eng.rollout_config.prompt_length)
        data = build_dataproto(ids, items, eng.pad_token_id, eng.eos_token_ids, meta_info={"do_sample": False})

        def ours() -> None:
            eng.generate(texts, temperature=0, max_tokens=new_tokens)

        def reference() -> None:
            eng.rollout.generate_sequences(data, max_new_tokens=new_tokens)

        pair = side_by_side(reference, ours, repeats)
    return {"prompts": prompts, "new_tokens": new_tokens, "ours_s": round(pair.ours_s, 4),
            "reference_s": round(pair.reference_s, 4), "ratio": round(pair.ours_s / pair.reference_s, 3),
            "ms_per_prompt": round((pair.ours_s - pair.reference_s) / prompts * 1e3, 4)}
