#!/usr/bin/env python
"""Check a CUDA install of the SGLang backend: start the lane's SGLang engine, generate, print timings.

    pip install -e '.[sglang]'                                   # verl06 lane: veRL 0.6.0's SGLangRollout, SGLang 0.5.2
    pip install 'sglang==0.5.12'                                 # verl09 lane: SGLang 0.5.12's Engine, driven directly
    python scripts/gpu_smoke.py                                  # configs/sglang_qwen3.yaml
    python scripts/gpu_smoke.py --config my.yaml --prompts 256 --max-tokens 256

Besides generating with the real kernels (fa3 or flashinfer, CUDA graphs, NCCL's group), it checks what the CPU
test suite cannot: a stop string and an out-of-vocabulary id on CUDA (the latter a device-side assert in SGLang's
scheduler) leave the engine serving; a cartridge is served from SGLang's radix cache (on either lane: 0.5.2 via
veRL's class, 0.5.12 via final's own engine wrapper), takes no GPU memory outside SGLang's KV pool, and streams;
where the backend honours seeds (verl09 with enable_deterministic_inference), one seed gives one answer.
Exit code 0 when all passed. Without CUDA or SGLang it exits 2 and says which is missing; 1 when a check failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "sglang_qwen3.yaml"


def gpu_memory() -> str:
    import torch

    if not torch.cuda.is_available():
        return "n/a (no CUDA)"
    free, total = torch.cuda.mem_get_info()  # the whole device: SGLang's scheduler is another process
    return f"{(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use on {torch.cuda.get_device_name()}"


def device_bytes_in_use() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return total - free


def check_fixes(engine: Any) -> list[str]:
    """What broke SGLang 0.5.2 under veRL 0.6.0 before final handled it, then the cartridge and seed checks;
    returns the failures."""
    from final.errors import PromptError

    failures = []
    stopped = engine.generate("Count: 1, 2, 3, 4, 5, 6, 7, 8", temperature=0, max_tokens=8, stop=[","])
    print(f"stop string: {stopped.completions[0]!r}")
    try:
        engine.generate([[engine.tokenizer.vocab_size + 1000]], max_tokens=4)
        failures.append("an out-of-vocabulary id was not refused")
    except PromptError as exc:
        print(f"out-of-vocabulary id refused: {exc}")
    if not engine.generate("Say hi.", temperature=0, max_tokens=4).completions[0]:
        failures.append("no answer after the refused request")
    return failures + check_cartridge(engine) + check_seeds(engine)


def check_cartridge(engine: Any) -> list[str]:
    """A random 512-token cartridge, loaded as a user would (a file), served from the radix cache and streamed."""
    import asyncio
    import tempfile

    import torch

    from final.cartridges.format import CartridgeKV, save_cartridge

    hf = engine.model_config.hf_config
    heads = hf.num_key_value_heads
    dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv = [torch.randn(1, heads, 512, dim, dtype=torch.bfloat16) * 0.1 for _ in range(hf.num_hidden_layers)]
    size = 2 * sum(t.numel() * t.element_size() for t in kv)
    failures = []
    with tempfile.TemporaryDirectory() as folder:
        path = save_cartridge(CartridgeKV(kv, kv, num_frozen_tokens=1), Path(folder) / "gpu-smoke.safetensors")
        before = device_bytes_in_use()
        engine.load_cartridge(id="gpu-smoke", path=str(path))
    grew = (device_bytes_in_use() or 0) - (before or 0)
    memory = engine.rollout.cartridge_memory()
    print(f"cartridge of {size / 2**20:.0f} MiB: GPU use grew {grew / 2**20:.0f} MiB; scheduler copy {memory}")
    if memory["device_bytes"] or (before is not None and (grew > size // 2 or not memory["pinned"])):
        failures.append("cartridge KV is kept on the GPU outside SGLang's KV pool")
    out = engine.generate("Say hi.", cartridge="gpu-smoke", temperature=0, max_tokens=4)
    print(f"with the cartridge: {out.completions[0]!r}, {out.metadata[0]['cached_tokens']} tokens from the cache")
    if out.metadata[0]["cached_tokens"] < 512:
        failures.append("the cartridge was not served from SGLang's radix cache")

    async def stream() -> list:
        request = engine.prepare("Say hi.", cartridge="gpu-smoke", temperature=0, max_tokens=4)
        return [row async for row in engine.astream(request)]

    rows = asyncio.run(stream())
    print(f"stream with the cartridge: {len(rows)} update(s)")
    if rows[-1].output_ids != out.token_ids[0]:
        failures.append("the cartridge's stream differs from its generate()")
    engine.unload_cartridge("gpu-smoke")
    return failures


def check_seeds(engine: Any) -> list[str]:
    """verl09 with enable_deterministic_inference: the same seed, the same sample; other seeds differ (8 rows)."""
    if not engine.rollout.capabilities.seed:
        print("seeds: refused by this backend's config (see README: enable_deterministic_inference)")
        return []
    def draw(seed: int) -> list[list[int]]:
        return engine.generate("Write a word.", temperature=1.0, max_tokens=8, n=8, seed=seed).token_ids

    first, again = draw(7), draw(7)
    print(f"seeds: {len({tuple(r) for r in first})} distinct rows of 8, repeatable: {first == again}")
    return [] if first == again else ["the same seed gave different samples"]
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="config file (rollout.name is forced to sglang)")
    p.add_argument("--prompts", type=int, default=64, help="batch size of the throughput run")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per completion in the throughput run")
    args = p.parse_args(argv)

    from final.config import load_config
    from final.errors import FinalError
    from final.inf import InferenceEngine
    from final.rollout.sglang.config import preflight

    try:
        preflight(load_config(args.config, {"rollout": {"name": "sglang"}}))
        t0 = time.perf_counter()
        with InferenceEngine(args.config, rollout={"name": "sglang"}, progress=False) as engine:
            started = time.perf_counter() - t0
            print(f"engine started in {started:.1f} s ({engine.config.model_path}); GPU memory: {gpu_memory()}")
            t1 = time.perf_counter()
            first = engine.generate("What is 2+2? Answer with a number.", temperature=0, max_tokens=16)
            print(f"first answer in {time.perf_counter() - t1:.2f} s: {first.completions[0]!r}")
            prompts = [f"Write one sentence about the number {i}." for i in range(args.prompts)]
            t2 = time.perf_counter()
            batch = engine.generate(prompts, temperature=0.7, max_tokens=args.max_tokens)
            took = time.perf_counter() - t2
            tokens = sum(len(ids) for ids in batch.token_ids)
            print(f"{args.prompts} prompts, {tokens} tokens in {took:.2f} s: {tokens / took:.0f} tokens/s")
            print(f"GPU memory: {gpu_memory()}")
            failures = check_fixes(engine)
    except FinalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    if failures:
        return 1
    print("ok: the SGLang backend works")
    return 0


if __name__ == "__main__":  # SGLang's scheduler is spawned: the guard keeps the child from re-running main()
    sys.exit(main())
