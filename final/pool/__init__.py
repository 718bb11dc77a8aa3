"""Data parallelism on Ray: a pool of N InferenceEngines behind InferenceEngine's own API.

- pool.py: `ReplicaPool` (a call's chunks, seeds, limits) and `open_engine` (one engine, or a pool);
- dispatch.py: one call's work queue (chunks to replicas, a dead replica's chunk retried once);
- router.py: which replica takes a chunk (the one holding its prefix, else the least loaded over every call);
- replicas.py: the replicas over time (deaths, restarts, the record a restarted replica replays);
- replica.py: the `Replica` actor and the Ray side (start/join/stop Ray, placement, Ray's exceptions -> ours);
- chunks.py: how a call is cut into chunks and its rows put back in order.

    from final.pool import open_engine
    with open_engine("config.yaml", replicas=2) as engine:
        out = engine.generate(prompts, n=4, temperature=1.0, seed=0)
"""

from final.pool.pool import ReplicaPool, open_engine

__all__ = ["ReplicaPool", "open_engine"]
