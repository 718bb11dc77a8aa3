#!/usr/bin/env python
"""Weight updates into the embedded engine on a GPU (issue 41's device check): greedy parity with HF generate on the
same device before and after a full and a partial update, the cost of a full update from CPU and from GPU tensors,
and what release() gives back. Needs only torch + transformers (no veRL, Ray or SGLang: it drives
final.engine.EmbeddedEngine directly, as LocalRollout does), so it runs on a bare CUDA image.

The model is SmolLM2-135M's architecture (30 layers, 576 wide, 9 heads / 3 KV heads, tied 49152-token embedding)
with random weights drawn from a seed: the update path and its numerics do not depend on what the weights learned.

    python scripts/gpu_weights.py --device cuda            # fp32 and bf16, prints one JSON line
    (final's config imports pydantic: install final with pip first, or put its wheels on PYTHONPATH)
    python scripts/gpu_weights.py --device cpu --layers 2  # the same checks on this machine, small
Exit code 0 when every parity check passed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def smollm2_shaped(folder: Path, layers: int, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # random init's std 0.02 gives near-uniform logits: scale up so greedy has clear winners
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def hf_model(folder: Path, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


def hf_greedy(model, prompts: list[list[int]], n: int, device: str) -> list[list[int]]:
    out = []
    for ids in prompts:
        x = torch.tensor([ids], device=device)
        got = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=2)
        out.append(got[0, len(ids):].tolist())
    return out


def engine_greedy(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = engine.generate(prompts, {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
    return [o["output_ids"] for o in outs]


def perturb(model, scale: float, seed: int, only: str | None = None) -> None:
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only is None or only in name:
                p.add_((torch.randn(p.shape, generator=g) * scale * p.float().std().cpu()).to(p.device, p.dtype))


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of tokens equal up to each row's first difference (bf16 rounding may flip a near-tie)."""
    same = total = 0
    for x, y in zip(a, b):
        k = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x))
        same, total = same + k, total + len(x)
    return same / max(total, 1)


def check_dtype(folder: Path, device: str, dtype: torch.dtype, prompts, n: int, repeats: int) -> dict:
    from final.engine import EmbeddedEngine
    from final.weights import check_update, named_tensors

    engine = EmbeddedEngine(str(folder), dtype=dtype, device=device, max_model_len=512)
    try:
        shapes = engine.parameter_shapes()
        policy = hf_model(folder, device, dtype)
        res = {"before": agreement(engine_greedy(engine, prompts, n), hf_greedy(policy, prompts, n, device))}
        perturb(policy, 0.2, seed=1)  # a full update: every parameter
        full_cpu = {k: v.detach().cpu() for k, v in policy.state_dict().items()}
        cpu_ms, gpu_ms, check_ms = [], [], []
        for i in range(repeats):  # from CPU tensors (a trainer elsewhere), then the policy's own device tensors
            for source, times in ((full_cpu, cpu_ms), (policy.state_dict(), gpu_ms)):
                start = time.perf_counter()
                named = check_update(named_tensors(source), shapes)
                mid = time.perf_counter()
                engine.update_weights(named)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(1000 * (time.perf_counter() - start))
                check_ms.append(1000 * (mid - start))
        res["full"] = agreement(engine_greedy(engine, prompts, n), hf_greedy(policy, prompts, n, device))
        part = f"layers.{min(3, len(engine.model.layers) - 1)}.mlp"
        perturb(policy, 1.0, seed=2, only=part)  # a partial update: one layer's MLP
        engine.update_weights(check_update([(k, v) for k, v in policy.state_dict().items() if part in k], shapes))
        res["partial"] = agreement(engine_greedy(engine, prompts, n), hf_greedy(policy, prompts, n, device))
        res["update_ms_from_cpu"] = statistics.median(cpu_ms)
        res["update_ms_from_device"] = statistics.median(gpu_ms)
        res["check_ms"] = statistics.median(check_ms)
        start = time.perf_counter()
        engine_greedy(engine, prompts * 8, 64)
        res["generate_s_%dx64" % (len(prompts) * 8)] = time.perf_counter() - start
        if device == "cuda":
            held = torch.cuda.memory_allocated()
            engine.release_memory_occupation()
            res["release_freed_mib"] = (held - torch.cuda.memory_allocated()) / 2**20
        res["after_release"] = agreement(engine_greedy(engine, prompts, n), hf_greedy(policy, prompts, n, device))
        return res
    finally:
        engine.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    prompts = [[1, 504, 3456, 28, 253], [1, 17, 99], [1, 2035, 441, 873, 12, 9, 1111, 20, 330], [1, 40000, 7]]
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "layers": args.layers}
    with tempfile.TemporaryDirectory() as tmp:
        folder = smollm2_shaped(Path(tmp) / "m", args.layers, seed=0)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            report[name] = check_dtype(folder, args.device, dtype, prompts, args.tokens, args.repeats)
    print(json.dumps(report, indent=1))
    fp32 = report["fp32"]
    ok = all(fp32[k] == 1.0 for k in ("before", "full", "partial", "after_release"))
    print("fp32 parity with HF generate before/after full/partial updates and after release:",
          "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
