"""P1: greedy decode throughput, embedded engine vs HF `model.generate`, and the roofline note.

The reference is what a researcher would write: one batched `generate` call, left-padded, DynamicCache,
greedy, exactly `new_tokens` tokens per row (no early stop on either side). Ours is one batched request to
the embedded engine. Both use the same weights, dtype, prompts and threads, and run interleaved.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch

from final.compat import chat_ids
from final.bench.timing import copy_bandwidth, matmul_flops, on_own_thread, side_by_side, sync

QUESTIONS = ["What is the capital of France?", "Write a short poem about the sea.", "Explain photosynthesis briefly.",
             "Hi!", "List three prime numbers and explain why they are prime.", "Who wrote Hamlet?",
             "Describe a cat to someone who has never seen one.", "What is 17 times 23?"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def chat_prompts(tokenizer: Any, batch: int) -> list[list[int]]:
    """`batch` chat prompts of varied lengths (so the reference really pads)."""
    out = []
    for i in range(batch):
        q = QUESTIONS[i % len(QUESTIONS)] + " Please answer carefully." * (i // len(QUESTIONS))
        out.append(chat_ids(tokenizer, [{"role": "user", "content": q}], add_generation_prompt=True))
    return out


class HFReference:
    """HF transformers `generate`: batched, left-padded, DynamicCache, greedy, fixed length."""

    def __init__(self, model_dir: str, dtype: torch.dtype, device: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.model.generation_config.eos_token_id = None  # fixed length: never stop early
        self.device = device

    def generate(self, prompts: list[list[int]], new_tokens: int, pad_id: int) -> list[list[int]]:
        width = max(map(len, prompts))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                      pad_token_id=pad_id, use_cache=True)
        sync(self.device)
        return out[:, width:].tolist()


@dataclass
class ThroughputRow:
    dtype: str
    batch: int
    new_tokens: int
    ours_tok_s: float
    reference_tok_s: float
    parity_rows: int  # rows whose greedy tokens equal the reference's

    @property
    def ratio(self) -> float:
        return self.ours_tok_s / self.reference_tok_s

    def as_dict(self) -> dict:
        return {"dtype": self.dtype, "batch": self.batch, "new_tokens": self.new_tokens,
                "ours": round(self.ours_tok_s, 2), "reference": round(self.reference_tok_s, 2),
                "ratio": round(self.ratio, 3), "greedy_parity": f"{self.parity_rows}/{self.batch}"}


def run_throughput(model_dir: str, dtypes: list[str], batches: list[int], new_tokens: int, repeats: int,
                   device: str = "cpu", step_probe: bool = True) -> dict:
    """P1 rows for every dtype x batch, plus per-step decode times (for the roofline) at the smallest batch."""
    from transformers import AutoTokenizer

    from final.inf import local_engine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows: list[ThroughputRow] = []
    steps: dict[str, dict] = {}
    for name in dtypes:
        # the same prompts at every repeat: HF prefills them each time, so ours does too (no prefix cache)
        inference = local_engine(model_dir, dtype=str(DTYPES[name]).removeprefix("torch."), device=device,
                                 prefix_cache=False)
        engine = inference.engine
        # HF runs on the engine's own thread: one OpenMP team for both sides. A second thread with parallel torch
        # work makes libgomp throttle every team (~30% slower on 2 cores), which would handicap both unevenly.
        ref = engine.call(lambda _runner: HFReference(model_dir, DTYPES[name], device))
        try:
            for batch in batches:
                prompts = chat_prompts(tokenizer, batch)
                got: dict[str, Any] = {}

                def theirs(n: int = new_tokens) -> None:
                    got["ref"] = engine.call(lambda _runner: ref.generate(prompts, n, pad_id))

                def ours(n: int = new_tokens) -> None:
                    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
                    got["ours"] = [o["output_ids"] for o in engine.generate(prompts, params)]
                    sync(device)

                theirs(4)  # warm-up: kernels, oneDNN primitives, allocator; short so it costs little
                ours(4)
                pair = side_by_side(theirs, ours, repeats, warmup=0)
                tokens = batch * new_tokens
                parity = sum(a == b for a, b in zip(got["ours"], got["ref"]))
                rows.append(ThroughputRow(name, batch, new_tokens, tokens / pair.ours_s, tokens / pair.reference_s,
                                          parity))
                if step_probe and batch == min(batches):
                    # ms per decode step = (time for n tokens - time for 1 token) / (n - 1)
                    first = side_by_side(lambda: theirs(1), lambda: ours(1), repeats, warmup=0)
                    per = lambda full, one: max(full - one, 0.0) / (new_tokens - 1) * 1e3  # noqa: E731
                    steps[name] = {"batch": batch, "ours_ms": round(per(pair.ours_s, first.ours_s), 3),
                                   "reference_ms": round(per(pair.reference_s, first.reference_s), 3),
                                   "weight_bytes_per_step": _bytes_read_per_step(engine),
                                   "flops_per_step": _flops_per_step(engine, batch),
                                   "kv_bytes_per_step": _kv_bytes_per_step(engine, prompts, new_tokens)}
        finally:
            inference.shutdown()
            del ref
            gc.collect()
    return {"rows": [r.as_dict() for r in rows], "decode_steps": steps, "_rows": rows}


def _bytes_read_per_step(engine: Any) -> int:
    """Weight bytes a decode step must read: every layer matrix, the norms and the lm_head (the embedding
    lookup reads only a few rows)."""
    model = engine.model
    embed = model.embed.numel() * model.embed.element_size()
    shared = model.lm_head.weight is model.embed  # an unpacked tied lm_head is the embedding itself
    return model.nbytes - (0 if shared else embed)


def _flops_per_step(engine: Any, batch: int) -> int:
    """2 x (weights used in matmuls) x rows: the GEMM work of one decode step (attention is small here)."""
    model = engine.model
    params = sum(lin.out_features * lin.in_features for layer in model.layers
                 for lin in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))
    return 2 * batch * (params + model.lm_head.out_features * model.lm_head.in_features)


def _kv_bytes_per_step(engine: Any, prompts: list[list[int]], new_tokens: int) -> int:
    """KV bytes a step reads, averaged over the generation (each row's context grows by one per step)."""
    avg_context = sum(len(p) for p in prompts) / len(prompts) + new_tokens / 2
    per_token = engine.spec.kv_bytes_per_token * torch.empty((), dtype=engine.dtype).element_size()
    return int(len(prompts) * avg_context * per_token)


def roofline(steps: dict[str, dict], device: str) -> dict:
    """The decode-step floor per dtype: max(bytes that must be read / copy bandwidth, GEMM FLOPs / matmul peak)."""
    if device != "cpu":
        return {"note": "roofline measured on CPU only"}
    bandwidth = on_own_thread(copy_bandwidth)
    out = {"copy_bandwidth_gb_s": round(bandwidth / 1e9, 2), "dtypes": {}}
    for name, s in steps.items():
        nbytes = s["weight_bytes_per_step"] + s["kv_bytes_per_step"]
        peak = on_own_thread(lambda: matmul_flops(DTYPES[name]))
        memory_ms, compute_ms = nbytes / bandwidth * 1e3, s["flops_per_step"] / peak * 1e3
        floor_ms = max(memory_ms, compute_ms)
        out["dtypes"][name] = {
            "batch": s["batch"], "bytes_per_step_mb": round(nbytes / 1e6, 1), "memory_floor_ms": round(memory_ms, 2),
            "gflop_per_step": round(s["flops_per_step"] / 1e9, 2), "matmul_peak_gflop_s": round(peak / 1e9, 1),
            "compute_floor_ms": round(compute_ms, 2), "floor_ms": round(floor_ms, 2), "ours_ms": s["ours_ms"],
            "reference_ms": s["reference_ms"], "ours_over_floor": round(s["ours_ms"] / floor_ms, 2),
        }
    return out
