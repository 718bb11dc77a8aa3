#!/usr/bin/env python
"""Check a CUDA install of the SGLang backend: start veRL's SGLangRollout, generate, print timings.

    pip install -e '.[sglang]'
    python scripts/gpu_smoke.py                                  # configs/sglang_qwen3.yaml
    python scripts/gpu_smoke.py --config my.yaml --prompts 256 --max-tokens 256

Exit code 0 when SGLang answered. Without CUDA or the [sglang] extra it exits 2 and says which is missing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "sglang_qwen3.yaml"


def gpu_memory() -> str:
    import torch

    if not torch.cuda.is_available():
        return "n/a (no CUDA)"
    free, total = torch.cuda.mem_get_info()  # the whole device: SGLang's scheduler is another process
    return f"{(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use on {torch.cuda.get_device_name()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="config file (rollout.name is forced to sglang)")
    p.add_argument("--prompts", type=int, default=64, help="batch size of the throughput run")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per completion in the throughput run")
    args = p.parse_args(argv)

    from final.config import load_config
    from final.errors import FinalError
    from final.inf import InferenceEngine
    from final.rollout.sglang import preflight

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
    except FinalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("ok: the SGLang backend works")
    return 0


if __name__ == "__main__":  # SGLang's scheduler is spawned: the guard keeps the child from re-running main()
    sys.exit(main())
