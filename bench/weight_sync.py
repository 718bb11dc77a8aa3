"""What a full weight update costs, per backend: `InferenceEngine.update_weights(policy)` with every parameter of
the model changed (SmolLM2-135M by default: 135M parameters, 540 MB in fp32), as an RL trainer calls it after each
optimizer step. Updates alternate between two perturbed copies so each one writes new values.

Backends (--backends, comma-separated):
  local        the embedded engine, fp32 (the C kernel's arena where it runs)
  local-int8   quantization: int8 (every matrix quantized again in place)
  local-bf16   quantization: bf16 weights
  sglang       SGLang 0.5.2 through veRL's SGLangRollout.update_weights (CPU: tests/sglang_cpu stand-ins)
  pool         a 2-replica Ray pool (one ray.put, every replica updated)
  serve        `final serve --weights-dir` over HTTP: the policy saved as safetensors, then POST
               /update_weights_from_disk (the save is timed apart)
Also: the update's check alone (names, shapes, finiteness: final.weights.check_update) and one generate call
(8 prompts x 64 tokens) on the updated engine beside it, for scale. Prints a table and one JSON line.

    .venv/bin/python bench/weight_sync.py --repeats 5
    .venv/bin/python bench/weight_sync.py --backends local,sglang,pool,serve --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def policies(model_dir: str, count: int = 2) -> list[dict]:
    """State dicts of the model with every parameter moved a little (new values each update)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    out = []
    for seed in range(count):
        g = torch.Generator().manual_seed(seed)
        out.append({k: v + torch.randn(v.shape, generator=g) * 1e-3 for k, v in base.items()})
    return out


def config(model: str, backend: str, device: str) -> dict:
    rollout: dict = {"name": "local", "prompt_length": 256, "response_length": 64,
                     "engine_kwargs": {"local": {"device": device}}}
    if backend in ("local-int8", "local-bf16"):
        rollout["engine_kwargs"]["local"]["quantization"] = backend.split("-")[1]
    if backend == "sglang":
        rollout = {"name": "sglang", "dtype": "float32", "prompt_length": 256, "response_length": 64,
                   "engine_kwargs": {"sglang": {"device": "cpu", "log_level": "warning", "max_total_tokens": 4096}
                                     if device == "cpu" else {}}}
    return {"model_path": model, "progress": False, "rollout": rollout}


def timed_updates(engine, states: list[dict], repeats: int) -> list[float]:
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        engine.update_weights(states[i % len(states)])
        times.append(time.perf_counter() - start)
    return times


def generate_s(engine) -> float:
    prompts = [f"Write a sentence about the number {i}." for i in range(8)]
    start = time.perf_counter()
    engine.generate(prompts, temperature=0, max_tokens=64, ignore_eos=True)
    return time.perf_counter() - start


def bench_engine(model: str, backend: str, states: list[dict], repeats: int, device: str) -> dict:
    if backend == "sglang":
        sys.path.insert(0, str(HERE.parent / "tests"))
        from sglang_helpers import use_sglang_cpu

        if device == "cpu":
            use_sglang_cpu()
    if backend == "pool":
        from final.pool import ReplicaPool

        engine = ReplicaPool(config(model, "local", device), replicas=2)
    else:
        from final.inf import InferenceEngine

        engine = InferenceEngine(config(model, backend, device))
    with engine:
        engine.generate("warm up", max_tokens=4)
        times = timed_updates(engine, states, repeats)
        return {"update_ms": 1000 * statistics.median(times), "all_ms": [round(1000 * t, 1) for t in times],
                "generate_8x64_s": generate_s(engine)}


def bench_serve(model: str, states: list[dict], repeats: int) -> dict:
    import httpx

    from final.inf import InferenceEngine
    from final.server.app import ServerThread, create_app
    from final.weights import save_weights

    with tempfile.TemporaryDirectory() as root, InferenceEngine(config(model, "local", "cpu")) as inference, \
            ServerThread(create_app(inference, weights_dir=root)) as server:
        saves, posts = [], []
        for i in range(repeats):
            start = time.perf_counter()
            save_weights(list(states[i % len(states)].items()), Path(root) / f"w{i}.safetensors")
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            r = httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": f"w{i}.safetensors"},
                           timeout=600)
            r.raise_for_status()
            posts.append(time.perf_counter() - start)
            os.unlink(Path(root) / f"w{i}.safetensors")
        return {"update_ms": 1000 * statistics.median(posts), "save_ms": 1000 * statistics.median(saves),
                "all_ms": [round(1000 * t, 1) for t in posts]}


def bench_check(model_dir: str, states: list[dict], repeats: int) -> dict:
    from final.weights import check_update, hf_parameter_shapes, named_tensors

    shapes = hf_parameter_shapes(model_dir)
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        check_update(named_tensors(states[i % len(states)]), shapes)
        times.append(time.perf_counter() - start)
    return {"update_ms": 1000 * statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--backends", default="local,local-int8,local-bf16,sglang,pool,serve")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    from final.models import resolve_model_path

    model_dir = resolve_model_path(args.model)
    states = policies(model_dir)
    nbytes = sum(v.numel() * v.element_size() for v in states[0].values())
    results = {"check": bench_check(model_dir, states, args.repeats)}
    for backend in args.backends.split(","):
        if backend == "serve":
            results[backend] = bench_serve(args.model, states, args.repeats)
        else:
            results[backend] = bench_engine(args.model, backend, states, args.repeats, args.device)
    print(f"full update of {args.model} ({nbytes / 2**20:.0f} MiB fp32, {len(states[0])} tensors), median of "
          f"{args.repeats}; load {os.getloadavg()[0]:.1f}")
    for name, r in results.items():
        extra = "".join(f"  {k} {v:.2f}" for k, v in r.items() if k not in ("update_ms", "all_ms"))
        print(f"  {name:11s} {r['update_ms']:9.1f} ms{extra}")
    print(json.dumps({"model": args.model, "mib": nbytes / 2**20, "cpu": platform.processor() or platform.machine(),
                      "threads": torch.get_num_threads(), "results": results}))


if __name__ == "__main__":
    main()
