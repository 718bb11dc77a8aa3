"""`final bench --only soak`: a real `final serve` on loopback under a long mixed load (issue 13).

The server is a subprocess (`python -m final.cli serve`), driven over HTTP by `concurrency` clients with a seeded
mix: plain completions, chats with n > 1, streams read to the end, streams cut after their first token, bad
bodies (NaN, huge n, wrong types, invalid JSON, a form post, a body past the limit), cartridge requests that
cycle through more cartridge files than the cartridge budget holds, some forcing a reload, so cartridges are
loaded and evicted while others are in use, and weight updates (POST /update_weights_from_disk, keeping the
cartridges) that alternate between a perturbed copy of one layer and the model's own weights while the rest runs:
each must answer with the next weights version, and GET /get_weight_version must agree. Reported: latency p50/p99 of
answered requests, statuses that differ from what each request should get (goal 0), the server's RSS at every tenth
of the requests and its drift over the second half (goal < 5%), the references held on cartridges once idle (goal
0), whether it is alive, and its exit status after SIGTERM.

Why the second half: the first fills what is bounded but filled by use, above all oneDNN's JIT kernels, one per
weight shape and row bucket (final/engine/linear.py, padded_rows; with the prefix cache a server's prefills see more
row counts, and the tiny model's RSS rises ~270 MB over its first ~2,500 requests, ~125 MB of it gone with
ONEDNN_PRIMITIVE_CACHE_CAPACITY=8), then stays flat; a leak keeps growing through the second half.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from final.cartridges.format import CartridgeKV, save_cartridge
from final.models import resolve_model_path
from final.process_group import free_port

GOALS = {"unexpected": 0, "rss_drift": 0.05, "cartridge_refs": 0}
MIX = {"complete": 30, "chat_n": 15, "stream_full": 10, "stream_cut": 15, "bad": 15, "cartridge": 15, "weights": 3}
UPDATES = ("tweak.safetensors", "base.safetensors")  # alternately: one layer perturbed, then the model's own
CARTRIDGE_FILES, CARTRIDGE_TOKENS, BUDGET_CARTRIDGES = 6, 32, 3  # more files than the budget holds
WORDS = "the a lighthouse keeper river ferry stone cat red blue north tide lamp road seven quiet".split()


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)  # answered requests (cut streams excluded)
    kinds: collections.Counter = field(default_factory=collections.Counter)
    statuses: collections.Counter = field(default_factory=collections.Counter)
    unexpected: int = 0  # requests whose status (or body) is not what they should get
    examples: list[str] = field(default_factory=list)
    done: int = 0
    weights_version: int = 0  # the server's, as its last update answered

    def wrong(self, what: str) -> None:
        self.unexpected += 1
        if len(self.examples) < 10:
            self.examples.append(what)


def run_soak(model: str, requests: int, seconds: float, concurrency: int, seed: int = 0) -> dict:
    """Start `final serve`, drive `requests` mixed requests (stopping early after `seconds`), report."""
    import psutil

    with tempfile.TemporaryDirectory(prefix="final-soak-") as tmp:
        files, one = _cartridge_files(model, Path(tmp))
        _weight_files(model, Path(tmp) / "weights")
        config = Path(tmp) / "config.yaml"
        config.write_text(json.dumps({"model_path": model, "progress": False,
                                      # a prefix cache the warm-up fills (its bound): growth after it is a leak
                                      "rollout": {"name": "local", "prompt_length": 256, "response_length": 32,
                                                  "max_num_seqs": 64,
                                                  "engine_kwargs": {"local": {"prefix_cache_mb": 4}}},
                                      "limits": {"max_body_bytes": 65536,
                                                 "max_cartridge_bytes": BUDGET_CARTRIDGES * one}}))
        proc, url = _start(config, tmp)
        try:
            server = psutil.Process(proc.pid)
            tally, rss = Tally(), {}
            start = time.perf_counter()
            asyncio.run(_drive(url, files, requests, seconds, concurrency, seed, tally, server, rss))
            elapsed = time.perf_counter() - start
            return _result(url, proc, server, tally, rss, elapsed, concurrency)
        finally:
            _stop(proc)


def _cartridge_files(model: str, folder: Path) -> tuple[list[str], int]:
    """Random cartridges of the model's shape (the soak tests serving them, not what they say)."""
    import torch

    cfg = json.loads((Path(resolve_model_path(model)) / "config.json").read_text())
    heads, layers = cfg.get("num_key_value_heads", cfg["num_attention_heads"]), cfg["num_hidden_layers"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    g = torch.Generator().manual_seed(0)
    names, nbytes = [], 0
    for i in range(CARTRIDGE_FILES):
        shape = (1, heads, CARTRIDGE_TOKENS, dim)
        cart = CartridgeKV([torch.randn(shape, generator=g) for _ in range(layers)],
                           [torch.randn(shape, generator=g) for _ in range(layers)], 1)
        save_cartridge(cart, folder / f"cart{i}.pt")
        names.append(f"cart{i}.pt")
        nbytes = cart.nbytes
    return names, nbytes


def _start(config: Path, folder: str, tries: int = 3) -> tuple[subprocess.Popen, str]:
    """`final serve` on a free port; a port taken between the choice and the bind (another process under load)
    makes the server exit at once: then another port."""
    import httpx

    for _ in range(tries):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "final.cli", "serve", "--config", str(config), "--port",
                                 str(port), "--cartridge-dir", folder, "--weights-dir", str(Path(folder) / "weights"),
                                 "--log-level", "warning", "--grace", "30"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 300
        while time.monotonic() < end and proc.poll() is None:
            try:
                if httpx.get(f"{url}/ping", timeout=5).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                time.sleep(0.2)
        exited = proc.poll() is not None  # at once (the port was taken), not after the wait
        _stop(proc)
        if not exited:
            break
    raise RuntimeError("final serve did not start for the soak")


def _stop(proc: subprocess.Popen) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


async def _drive(url: str, files: list[str], requests: int, seconds: float, concurrency: int, seed: int,
                 tally: Tally, server: Any, rss: dict) -> None:
    """Workers take the seeded plan in order; two of them take the cartridge requests (so at most two cartridges
    are in use at once and the budget always has room), one the weight updates (so versions follow each other),
    the rest everything else."""
    import httpx

    rng = random.Random(seed)
    kinds = rng.choices(list(MIX), weights=list(MIX.values()), k=requests)
    plain = [(i, k) for i, k in enumerate(kinds) if k not in ("cartridge", "weights")]
    carts = [(i, k) for i, k in enumerate(kinds) if k == "cartridge"]
    updates = [(i, k) for i, k in enumerate(kinds) if k == "weights"]
    queues = (collections.deque(plain), collections.deque(carts), collections.deque(updates))
    tenth = max(requests // 10, 1)
    stop_at = time.monotonic() + seconds

    async def worker(queue: collections.deque, client: Any) -> None:
        while queue and time.monotonic() < stop_at:
            i, kind = queue.popleft()
            await _one(client, kind, random.Random(seed * 1_000_003 + i), files, tally)
            tally.done += 1
            if tally.done % tenth == 0:
                rss.setdefault("series", []).append(server.memory_info().rss)
                if tally.done == 5 * tenth:
                    rss["warm"] = rss["series"][-1]

    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        workers = [worker(queues[1], client) for _ in range(2)] + [worker(queues[2], client)] + \
                  [worker(queues[0], client) for _ in range(max(concurrency - 3, 1))]
        await asyncio.gather(*workers)
    rss["end"] = server.memory_info().rss


async def _one(client: Any, kind: str, rng: random.Random, files: list[str], tally: Tally) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
    body: dict = {"model": "soak", "prompt": prompt, "max_tokens": rng.randint(4, 16),
                  "temperature": rng.choice([0.0, 1.0]), "seed": rng.randrange(1 << 30)}
    tally.kinds[kind] += 1
    start = time.perf_counter()
    if kind == "chat_n":
        n = rng.randint(2, 4)
        chat = {**body, "messages": [{"role": "user", "content": prompt}], "n": n}
        del chat["prompt"]
        resp = await client.post("/v1/chat/completions", json=chat)
        ok = resp.status_code == 200 and len(resp.json()["choices"]) == n
        _record(tally, kind, resp, ok, start)
    elif kind in ("stream_full", "stream_cut"):
        await _stream(client, kind, {**body, "stream": True, "max_tokens": 32 if kind == "stream_cut" else 16},
                      tally, start)
    elif kind == "weights":
        await _update(client, tally, start)
    elif kind == "bad":
        content, headers, want = _bad(rng, body)
        resp = await client.post("/v1/completions", content=content, headers=headers)
        ok = resp.status_code == want and "error" in resp.json()
        _record(tally, kind, resp, ok, start)
    else:
        path = "/v1/completions"
        if kind == "cartridge":
            path = "/custom/cartridge/completions"
            body["cartridges"] = [{"id": rng.choice(files), "source": "local", "force_redownload": rng.random() < 0.2}]
        resp = await client.post(path, json=body)
        ok = resp.status_code == 200 and len(resp.json()["choices"]) == 1
        _record(tally, kind, resp, ok, start)


async def _stream(client: Any, kind: str, body: dict, tally: Tally, start: float) -> None:
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if kind == "stream_cut":  # hang up after the first event: the server must free the rows
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    break
            tally.statuses[(kind, resp.status_code)] += 1
            if resp.status_code != 200:
                tally.wrong(f"{kind}: HTTP {resp.status_code}")
            return
        lines = [line async for line in resp.aiter_lines() if line]
    ok = resp.status_code == 200 and lines[-1:] == ["data: [DONE]"] and not any('"error"' in x for x in lines)
    _record(tally, kind, resp, ok, start)


async def _update(client: Any, tally: Tally, start: float) -> None:
    """The next weight update (keeping the cartridges): its answer and the version route must say version + 1."""
    want = tally.weights_version + 1
    body = {"model_path": UPDATES[tally.weights_version % 2], "keep_cartridges": True}
    resp = await client.post("/update_weights_from_disk", json=body)
    ok = resp.status_code == 200 and resp.json().get("weights_version") == want
    if ok:
        tally.weights_version = want
        version = await client.get("/get_weight_version")
        ok = version.status_code == 200 and version.json() == {"weight_version": want}
    _record(tally, "weights", resp, ok, start)


def _weight_files(model: str, folder: Path) -> None:
    """The model's own weights (base) and a copy of one matrix perturbed (tweak): updates to and fro."""
    import torch
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    state: dict = {}
    for file in sorted(Path(resolve_model_path(model)).glob("*.safetensors")):
        state.update(load_file(str(file)))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / UPDATES[1]))
    name = next(k for k in state if k.endswith("layers.0.mlp.down_proj.weight"))
    g = torch.Generator().manual_seed(0)
    tweak = state[name] + 0.01 * torch.randn(state[name].shape, generator=g).to(state[name].dtype)
    save_file({name: tweak.contiguous()}, str(folder / UPDATES[0]))


def _bad(rng: random.Random, body: dict) -> tuple[bytes, dict, int]:
    """A malformed request and the status it must get."""
    json_type = {"content-type": "application/json"}
    cases = [
        (json.dumps({**body, "temperature": float("nan")}).encode(), json_type, 400),
        (json.dumps({**body, "n": 100000}).encode(), json_type, 400),
        (json.dumps({**body, "prompt": {"x": 1}}).encode(), json_type, 400),
        (json.dumps({**body, "stop": ["s"] * 20}).encode(), json_type, 400),
        (b'{"model": "soak", "prompt": [1, 2', json_type, 400),
        (b"", json_type, 400),
        (json.dumps(body).encode(), {"content-type": "application/x-www-form-urlencoded"}, 415),
        (json.dumps({**body, "prompt": "word " * 20000}).encode(), json_type, 413),
    ]
    return rng.choice(cases)


def _record(tally: Tally, kind: str, resp: Any, ok: bool, start: float) -> None:
    tally.statuses[(kind, resp.status_code)] += 1
    if ok:
        tally.latencies.append(time.perf_counter() - start)
    else:
        tally.wrong(f"{kind}: HTTP {resp.status_code} {resp.text[:300]}")


def _result(url: str, proc: subprocess.Popen, server: Any, tally: Tally, rss: dict, elapsed: float,
            concurrency: int) -> dict:
    import httpx

    usage = httpx.get(f"{url}/custom/cartridges", timeout=60).json()
    alive = proc.poll() is None and httpx.get(f"{url}/ping", timeout=60).status_code == 200
    lat = sorted(tally.latencies)
    pct = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3, 1) if lat else None)  # noqa: E731
    drift = (rss["end"] - rss["warm"]) / rss["warm"] if "warm" in rss else None
    refs = sum(c["refcount"] for c in usage["cartridges"] or [])
    unexpected = tally.unexpected
    exit_code = _stop(proc)
    return {"soak": {
        "requests": tally.done, "seconds": round(elapsed, 1), "concurrency": concurrency,
        "requests_per_s": round(tally.done / elapsed, 1), "kinds": dict(tally.kinds),
        "statuses": {f"{k} {s}": n for (k, s), n in sorted(tally.statuses.items())},
        "p50_ms": pct(0.50), "p99_ms": pct(0.99), "unexpected": unexpected,
        "unexpected_examples": tally.examples,
        "rss_series_mb": [round(x / 2**20, 1) for x in rss.get("series", [])],
        "rss_half_mb": round(rss.get("warm", 0) / 2**20, 1), "rss_end_mb": round(rss["end"] / 2**20, 1),
        "rss_drift": None if drift is None else round(drift, 4), "cartridge_refs_end": refs,
        "cartridges_loaded_end": len(usage["cartridges"] or []), "cartridge_metrics": usage["metrics"],
        "weight_updates": tally.weights_version, "alive": alive, "exit_code_after_sigterm": exit_code,
        "goals": GOALS,
        "met": unexpected == 0 and drift is not None and drift < GOALS["rss_drift"] and refs == 0 and alive}}


def describe(s: dict) -> str:
    m = s["cartridge_metrics"] or {}
    return (f"{s['requests']} requests in {s['seconds']} s ({s['requests_per_s']}/s, {s['concurrency']} clients): "
            f"p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms; unexpected statuses {s['unexpected']}; RSS "
            f"{s['rss_half_mb']} at half the requests -> {s['rss_end_mb']} MB ({s['rss_drift']:+.2%}; every tenth: "
            f"{s['rss_series_mb']}); cartridge references held at the "
            f"end {s['cartridge_refs_end']} (loads {m.get('loads')}, evictions {m.get('evictions')}); weight updates "
            f"{s['weight_updates']}; alive "
            f"{s['alive']}; exit after SIGTERM {s['exit_code_after_sigterm']}")

