"""final.pool.router without Ray: where a pool's chunks go. Load counts rows in flight over every call, a chunk goes
to the replica that ran its prompts' prefix unless that one is much busier, and the map forgets what the engines'
caches lost. tests/test_pool.py runs the same routing on a real 2-replica pool."""

from __future__ import annotations

import pytest

from final.errors import ConfigError
from final.outputs import GenerationOutput
from final.pool.chunks import plan_chunks
from final.pool.replicas import Replicas
from final.pool.router import BALANCE_ABS_ROWS, BLOCK, Router, block_hashes, check_routing
from final.request import Request
from final.sampling import Sampling


def pool_router(replicas: int = 2, routing: str = "cache_aware") -> Router:
    """A Router over a pool's replica record (no actors started: routing reads only which serve, and their starts)."""
    return Router(Replicas(None, [None] * replicas, [{}] * replicas, max_restarts=0, timeout=1.0), routing)


def request(*ids: list[int], cartridge: tuple | None = None) -> Request:
    return Request(list(ids), list(ids), Sampling({}, 8), [cartridge] * len(ids) if cartridge else None)


def one_call(router: Router, ids: list[int], free=(0, 1), **kw) -> int:
    """Route a one-prompt call; returns the replica it went to (its row stays in flight)."""
    route = router.call(request(ids, **kw), plan_chunks(1, 1, 2, 256))
    [(chunk, replica)] = route.assign([0], list(free))
    assert chunk == 0
    return replica


def ran(router: Router, ids: list[int], output: list[int], free=(0, 1)) -> int:
    """A one-prompt call that ran and came back: returns its replica (its prompt + output are its cache now)."""
    route = router.call(request(ids), plan_chunks(1, 1, 2, 256))
    [(_, replica)] = route.assign([0], list(free))
    route.returned(0, replica, router.replicas.generation[replica], GenerationOutput(["x"], [output], [{}], 1))
    router.release(replica, 1)
    return replica


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_block_hashes_name_a_prefix_and_what_sets_its_kv():
    a, b = tokens(0, 40), tokens(0, 32) + tokens(500, 8)
    assert len(block_hashes(a, 0)) == 40 // BLOCK  # a partial block has no hash
    assert block_hashes(a, 0)[:2] == block_hashes(b, 0)[:2]  # equal blocks, equal prefix: equal hashes
    assert block_hashes([9] + a[1:], 0)[1] != block_hashes(a, 0)[1]  # a block's hash names everything before it
    assert block_hashes(a, 1) != block_hashes(a, 0)  # another cartridge or adapter in front: another chain
    with pytest.raises(ConfigError, match="routing"):
        check_routing("round_robin")


def test_concurrent_one_prompt_calls_spread_over_the_replicas():
    """Each call's chunk goes to the replica with the fewest rows in flight over every call (the bug: every call
    started from replica 0)."""
    router = pool_router()
    assert [one_call(router, tokens(1000 * i, 10)) for i in range(4)] == [0, 1, 0, 1]
    assert router.load == [2, 2]
    router.release(0, 2)
    assert one_call(router, tokens(9000, 10)) == 0 and router.load == [1, 2]
    # calls one at a time (nothing in flight) spread too: the replica that has served fewer rows goes first
    router = pool_router()
    assert [ran(router, tokens(1000 * i, 10), [1]) for i in range(4)] == [0, 1, 0, 1]


def test_a_conversation_goes_back_to_the_replica_holding_it_unless_that_one_is_much_busier():
    router = pool_router()
    turn1, answer = tokens(100, 40), tokens(7000, 8)
    home = ran(router, turn1, answer)
    turn2 = turn1 + answer + tokens(300, 10)
    # the other replica has served fewer rows (it would take an unrelated prompt), but this one holds the history
    assert one_call(router, turn2) == home
    router.release(home, 1)
    assert ran(router, turn2, tokens(7100, 8)) == home
    # busy with rows of other calls: a few more than the other replica is not "much busier"; past the thresholds is
    with router.lock:
        router.take(home, BALANCE_ABS_ROWS)
    assert one_call(router, turn2 + tokens(7100, 8)) == home
    with router.lock:
        router.take(home, 2)
    assert one_call(router, turn2 + tokens(7100, 8)) == 1 - home


def test_only_what_one_replica_holds_beyond_the_others_counts():
    router = pool_router()
    system = tokens(0, 48)  # a long shared system prompt, served on both replicas
    assert ran(router, system + tokens(1000, 4), [1]) == 0
    assert one_call(router, system + tokens(2000, 4)) == 0  # it pulls a prompt to the replica that holds it ...
    router.release(0, 1)
    ran(router, system + tokens(3000, 4), [1], free=[1])  # ... until both do
    assert [one_call(router, system + tokens(5000 + 100 * i, 4)) for i in range(4)] == [1, 0, 1, 0]  # by load
    # a conversation after that system prompt: its own history pulls it back, though it is short next to the
    # system prompt (what counts is what the other replica would have to compute)
    router.release(0, 2)
    router.release(1, 2)
    history = system + tokens(8000, 30)
    home = ran(router, history, tokens(9000, 8))
    with router.lock:
        router.take(home, 1)
    assert one_call(router, history + tokens(9000, 8) + tokens(9500, 20)) == home
    # a short common stretch (under CACHE_THRESHOLD of the prompt) does not pull a prompt either
    router = pool_router()
    ran(router, tokens(0, 16) + tokens(100, 30), [1])
    assert one_call(router, tokens(0, 16) + tokens(900, 30)) == 1


def test_a_cartridge_restart_update_or_unload_ends_the_affinity():
    router = pool_router()

    def goes_home(home: int, history: list[int], **kw) -> bool:
        """With a row in flight on home (a little busier), does the next turn still go there?"""
        with router.lock:
            router.take(home, 1)
        went = one_call(router, history + [6], **kw)
        router.release(home, 1)
        router.release(went, 1)
        return went == home

    history = tokens(100, 64)
    home = ran(router, history, [5])
    assert goes_home(home, history)
    assert not goes_home(home, history, cartridge=("doc",))  # other K/V in front: not held anywhere
    router.replicas.generation[home] += 1  # the replica was restarted: an empty cache
    assert not goes_home(home, history)
    history = tokens(1000, 64)
    home = ran(router, history, [5])
    assert goes_home(home, history)
    router.forget()  # a weight update, a release or a cartridge unload emptied every cache
    assert not goes_home(home, history)


def test_a_free_replica_takes_the_chunk_it_holds_and_load_balancing_routing_ignores_prefixes():
    router = pool_router()
    a, b = tokens(0, 40), tokens(1000, 40)
    first = ran(router, a, [1])
    assert ran(router, b, [1]) == 1 - first
    chunks = plan_chunks(2, 1, 2, 256, chunk_rows=1)  # one prompt a chunk: b first in the queue, then a
    route = router.call(request(b + [2], a + [2]), chunks)
    assert sorted(route.assign([0, 1], [0, 1])) == [(0, 1 - first), (1, first)]
    # one replica free: it takes the chunk it holds even when that is not first in the queue
    route = router.call(request(b + [3], a + [3]), chunks)
    assert route.assign([0, 1], [first]) == [(1, first)]
    plain = pool_router(routing="least_loaded")
    ran(plain, a, [1])
    assert one_call(plain, a + [2]) == 1  # the replica that served fewer rows, whatever it holds


def test_the_map_stays_bounded_and_keeps_a_chains_head(monkeypatch):
    import final.pool.router as router_module

    monkeypatch.setattr(router_module, "MAX_BLOCKS", 4)
    router = pool_router()
    home = ran(router, tokens(0, 6 * BLOCK), [1])
    assert len(router._blocks) == 4
    assert one_call(router, tokens(0, 6 * BLOCK) + [2]) == home  # its first 4 blocks are still there
