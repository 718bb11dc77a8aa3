"""What one training step's cartridge costs the server: seed 000's loop sends `force_redownload: true` with every
request, for a local file the trainer rewrites between steps.

Measures, on the embedded engine's CartridgeService (what `final serve` runs per request):
  unchanged  a request naming the file when it did not change: one stat of the file and its manifest, no read
  reload     the first request after the trainer rewrote it: read (torch.load weights_only), validate, load into
             the engine (what every request cost before the file was keyed on inode/size/mtime/ctime)
Each figure is the median of --repeats; the two alternate. Prints one JSON line.

    nice -n 5 .venv/bin/python bench/cartridge_reload.py --model builtin:smollm2-135m-instruct --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from final.cartridges.format import CartridgeKV, save_cartridge
from final.cartridges.manifest import ModelShape
from final.cartridges.service import CartridgeService
from final.engine import EmbeddedEngine
from final.models import resolve_model_path


def random_cartridge(model: ModelShape, tokens: int, seed: int) -> CartridgeKV:
    g = torch.Generator().manual_seed(seed)
    shape = (1, model.num_kv_heads, tokens, model.head_dim)
    keys = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(model.num_layers)]
    values = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(model.num_layers)]
    return CartridgeKV(keys, values, num_frozen_tokens=1)


def machine() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
        flags = next(line for line in text.splitlines() if line.startswith("flags")).split()
        have = [f for f in ("avx2", "avx512f", "amx_bf16") if f in flags]
    except (OSError, StopIteration):
        model, have = platform.processor(), []
    return f"{model}, {os.cpu_count()} cpus, {' '.join(have)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=2048, help="cartridge length in tokens")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    engine = EmbeddedEngine(resolve_model_path(args.model))
    try:
        service = CartridgeService(engine)
        carts = [random_cartridge(service.model, args.tokens, seed) for seed in (0, 1)]
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "training.pt"
            spec = [{"id": str(path), "source": "local", "force_redownload": True}]
            save_cartridge(carts[0], path)
            service.ensure(spec)
            unchanged, reload = [], []
            for i in range(args.repeats):
                t = time.perf_counter()
                service.ensure(spec)
                unchanged.append(time.perf_counter() - t)
                save_cartridge(carts[(i + 1) % 2], path)  # the trainer's step writes the next cartridge
                loads = service.metrics().loads
                t = time.perf_counter()
                service.ensure(spec)
                reload.append(time.perf_counter() - t)
                assert service.metrics().loads == loads + 1  # really reloaded
            nbytes = path.stat().st_size
    finally:
        engine.shutdown()
    u, r = statistics.median(unchanged), statistics.median(reload)
    print(json.dumps({"machine": machine(), "model": args.model, "cartridge_tokens": args.tokens,
                      "file_bytes": nbytes, "unchanged_ms": round(u * 1e3, 3), "reload_ms": round(r * 1e3, 1),
                      "reload_over_unchanged": round(r / u, 1), "repeats": args.repeats}))


if __name__ == "__main__":
    main()
