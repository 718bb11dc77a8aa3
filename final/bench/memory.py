"""P3: KV bytes held while `rows` concurrent requests share one cartridge, against the bytes of one cartridge.

Reuses final.cartridges.footprint: the footprint is taken on the engine thread while all rows are running,
counting the distinct storages behind the rows' cartridge prefixes. The headline ratio is cartridge bytes
held for all rows / bytes of one cartridge (1.0 = held once). The rows' own KV (their prompt and generated
tokens) comes on top; it is reported separately, both as the tokens they hold and as the row pool's capacity.
"""

from __future__ import annotations

from typing import Any

from final.bench.ttft import QUESTION, random_cartridge
from final.cartridges.footprint import measure_sharing


def run_memory(model_dir: str, cartridge_tokens: int, rows: int, new_tokens: int = 16, dtype: str = "auto",
               device: str = "cpu") -> dict:
    from transformers import AutoTokenizer

    from final.inf import local_engine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    question = tokenizer(QUESTION, add_special_tokens=False).input_ids
    inference = local_engine(model_dir, dtype=dtype, device=device, max_num_seqs=max(rows, 1))
    engine = inference.engine
    try:
        keys, values = random_cartridge(engine, cartridge_tokens)
        prefix = engine.load_cartridge("bench-shared", keys, values)
        del keys, values
        one_cartridge = prefix.nbytes
        per_token = engine.cache.bytes_per_token
        out = {"cartridge_tokens": cartridge_tokens, "rows": rows, "cartridge_bytes": one_cartridge}
        for label, n in (("one_row", 1), ("all_rows", rows)):
            engine.release_memory_occupation()  # so the row pool reflects this run only
            snap = measure_sharing(engine, ("bench-shared",), question, n, max_new_tokens=new_tokens)
            own_tokens = snap["running_rows"] * (len(question) + new_tokens)
            out[label] = {"running_rows": snap["running_rows"], "cartridge_bytes_held": snap["prefix_bytes"],
                          "row_tokens_bytes": own_tokens * per_token, "row_pool_bytes": snap["row_cache_bytes"]}
        held = out["all_rows"]
        out["ratio"] = round(held["cartridge_bytes_held"] / one_cartridge, 4)
        out["total_ratio_tokens"] = round((held["cartridge_bytes_held"] + held["row_tokens_bytes"]) / one_cartridge, 4)
        out["total_ratio_pool"] = round((held["cartridge_bytes_held"] + held["row_pool_bytes"]) / one_cartridge, 4)
        out["copy_per_row_ratio"] = float(held["running_rows"])  # what a per-row copy of the prefix would hold
    finally:
        inference.shutdown()
    return out


def describe(m: dict[str, Any]) -> str:
    mb = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    held = m["all_rows"]
    return (f"{held['running_rows']} rows share a {m['cartridge_tokens']}-token cartridge: cartridge bytes held "
            f"{mb(held['cartridge_bytes_held'])} vs one cartridge {mb(m['cartridge_bytes'])} = {m['ratio']:.2f}x; "
            f"with the rows' own tokens {m['total_ratio_tokens']:.2f}x, with the row pool's capacity "
            f"{m['total_ratio_pool']:.2f}x (a copy per row would be {m['copy_per_row_ratio']:.0f}x)")
