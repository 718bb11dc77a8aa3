"""A Ray pool's routing on multi-turn clients: prefix affinity ("cache_aware") vs load alone ("least_loaded").

    python bench/pool_routing.py                  # SmolLM2-135M, 2 replicas, 7 clients x 6 turns, ~100 new + ~48 out
    python bench/pool_routing.py --model builtin:tiny-random-llama --clients 4 --turns 3 --new 24 --generated 6 \
        --system 32 --repeats 1               # a quick check that it runs

Each client is one conversation sent as one call a turn (final serve's chat clients, an agent loop): a shared
system prompt (--system tokens, a tool list), then turns of about --new tokens, each call's prompt the whole
history with the previous answers (greedy, about --generated tokens each: each turn draws both between half and
1.5 times the figure, so clients drift apart as real ones do). All clients run at once over one pool, whose
routing is switched between the two policies; each phase has fresh conversations (no cache hit crosses phases)
and the order alternates over --repeats. Per policy: wall time (median), the share of prompt tokens that came
from a replica's prefix cache, the share of turns 2.. that went back to the previous turn's replica, rows per
replica; and the ratio of wall times. Token ids, so no chat template drifts between turns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections import Counter


def conversation(pool, system: list[int], rng: random.Random, turns: int, new: int, generated: int) -> list[dict]:
    """One client's turns (a coroutine's work): per turn its replica, prompt tokens and cached tokens."""

    async def run() -> list[dict]:
        history, out = list(system), []
        for _ in range(turns):
            history += [rng.randrange(200, 20000) for _ in range(rng.randint(new // 2, new * 3 // 2))]
            res = await pool.agenerate([history], temperature=0, ignore_eos=True,
                                       max_tokens=rng.randint(max(1, generated // 2), generated * 3 // 2))
            meta = res.metadata[0]
            out.append({"replica": meta["replica"], "prompt": len(history), "cached": meta["cached_tokens"]})
            history += list(res.token_ids[0])
        return out

    return run()


def phase(pool, routing: str, args: argparse.Namespace, seed: int) -> dict:
    pool.routing = routing
    rng = random.Random(seed)
    system = [rng.randrange(200, 20000) for _ in range(args.system)]
    clients = [conversation(pool, system, random.Random(seed * 1000 + i), args.turns, args.new, args.generated)
               for i in range(args.clients)]

    async def all_clients():
        return await asyncio.gather(*clients)

    start = time.perf_counter()
    turns = asyncio.run(all_clients())
    wall = time.perf_counter() - start
    flat = [t for conv in turns for t in conv]
    back = [b["replica"] == a["replica"] for conv in turns for a, b in zip(conv, conv[1:])]
    return {"wall_s": wall, "cached_share": sum(t["cached"] for t in flat) / sum(t["prompt"] for t in flat),
            "same_replica_share": sum(back) / max(1, len(back)),
            "rows_per_replica": dict(sorted(Counter(t["replica"] for t in flat).items()))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="builtin:smollm2-135m-instruct")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--clients", type=int, default=7)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system", type=int, default=256, help="shared system prompt tokens")
    p.add_argument("--new", type=int, default=100, help="new tokens a turn")
    p.add_argument("--generated", type=int, default=48, help="tokens generated a turn")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--balance-abs", type=int, help="final.pool.router.BALANCE_ABS_ROWS for this run (a sweep)")
    args = p.parse_args()

    import final.pool.router
    from final.pool import ReplicaPool

    if args.balance_abs is not None:  # the router runs in this process: its thresholds are read at each choice
        final.pool.router.BALANCE_ABS_ROWS = args.balance_abs
    args.balance_abs = final.pool.router.BALANCE_ABS_ROWS

    longest = args.system + args.turns * (args.new + args.generated) * 3 // 2
    config = {"model_path": args.model, "progress": False,
              "rollout": {"name": "local", "prompt_length": longest, "response_length": args.generated * 3 // 2,
                          "calculate_log_probs": False}}
    runs: dict[str, list[dict]] = {"cache_aware": [], "least_loaded": []}
    with ReplicaPool(config, replicas=args.replicas) as pool:
        phase(pool, "least_loaded", args, seed=0)  # warm-up (replicas' first calls), not counted
        for r in range(args.repeats):
            order = ("cache_aware", "least_loaded") if r % 2 == 0 else ("least_loaded", "cache_aware")
            for i, routing in enumerate(order):
                runs[routing].append(phase(pool, routing, args, seed=1 + 2 * r + i))
    result = {}
    for routing, rs in runs.items():
        result[routing] = {"wall_s": round(statistics.median(x["wall_s"] for x in rs), 3),
                           "cached_share": round(statistics.mean(x["cached_share"] for x in rs), 3),
                           "same_replica_share": round(statistics.mean(x["same_replica_share"] for x in rs), 3),
                           "rows_per_replica": rs[-1]["rows_per_replica"]}
    result["speedup"] = round(result["least_loaded"]["wall_s"] / result["cache_aware"]["wall_s"], 3)
    result["setup"] = vars(args)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
