"""What runs inside SGLang's scheduler process (the child that owns the KV pool), on both lanes (SGLang 0.5.2 and
0.5.12): cartridge injection, and stop strings for a scheduler started with skip_tokenizer_init (StopStringDecoder).

`Engine.collective_rpc(method, **params)` makes the scheduler call `getattr(self, method)(params)` on 0.5.2 and
`getattr(self, method)(**params)` on 0.5.12 (`_rpc_method` takes both). `run_scheduler_process` below is what the
spawned child runs: on 0.5.2 the parent replaces `sglang.srt.entrypoints.engine.run_scheduler_process` with it for
the duration of engine start (engine_052.py), on 0.5.12 an Engine subclass names it in `run_scheduler_process_func`
(engine_0512.py). Being a module-level function, the child imports and runs it, so the methods are added to the
Scheduler class in the child, where they are needed.

The radix cache's API is the other difference: 0.5.2 takes token lists and plain arguments, 0.5.12 one parameter
object per call (MatchPrefixParams, InsertParams, EvictParams) around a RadixKey; `_match`, `_insert` and `_evict`
speak whichever is installed.

Injection of a cartridge (or of an ordered composition of cartridges), given reserved token ids R:
  slots = the KV slots of the longest cached prefix of R, plus fresh ones from the allocator (evicting if needed)
  k_buffer[l][slots] = K_l (and V): the cartridge's post-RoPE KV, [T, H_kv, D] per layer (every slot: a cached
  prefix of R may hold KV that a prompt of reserved ids computed)
  tree_cache.insert(R, slots); lock the node so it is never evicted
A request R + prompt then matches R in the radix cache: the prompt is prefilled at positions p.. and attends to
the cartridge. Each cartridge's KV stays resident in host memory (pinned on CUDA; the pool slots are its only
device copy); every successful flush_cache (veRL flushes after each generate_sequences) and every resume of the
KV memory re-injects what is wanted, one host-to-device copy.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

KV_CACHE_TAG = "kv_cache"  # sglang.srt.constants.GPU_MEMORY_TYPE_KV_CACHE


def run_scheduler_process(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """Stands in for SGLang's run_scheduler_process in the spawned child: add the methods, then run SGLang's."""
    from sglang.srt.managers import schedule_batch, scheduler

    install(scheduler.Scheduler)
    if server_args.grammar_backend == "final":  # 0.5.12 (rollout_0512.py): the embedded engine's constraints
        from final.rollout.sglang.grammar_backend import register

        register()
    if server_args.skip_tokenizer_init:  # 0.5.12's engine (rollout_0512.py) loads its tokenizer: nothing to lend
        install_stop_strings(schedule_batch.Req, StopStringDecoder(server_args))
    scheduler.run_scheduler_process(server_args, *args, **kwargs)


class StopStringDecoder:
    """What `Req.check_finished` needs of a tokenizer to match stop strings, and nothing more: with
    skip_tokenizer_init SGLang 0.5.2's scheduler has no tokenizer, and a request with `stop` strings calls
    `None.decode` there, which kills the scheduler. eos_token_id / additional_stop_token_ids are None so that
    lending this to a request changes only the stop-string check (its eos ids come from the model config)."""

    eos_token_id = None
    additional_stop_token_ids = None

    def __init__(self, server_args: Any):
        self._args = server_args
        self._tokenizer = None

    def decode(self, ids: list[int]) -> str:
        if self._tokenizer is None:  # loaded at the first request that has stop strings
            from sglang.srt.hf_transformers_utils import get_tokenizer

            a = self._args
            self._tokenizer = get_tokenizer(a.tokenizer_path, tokenizer_mode=a.tokenizer_mode,
                                            trust_remote_code=a.trust_remote_code, revision=a.revision)
        return self._tokenizer.decode(ids)


def install_stop_strings(req_cls: type, decoder: StopStringDecoder) -> None:
    """Lend `decoder` to a tokenizer-less request while SGLang checks whether it finished: SGLang's own stop-string
    rule (decode the last stop_str_max_len + 1 output ids, look for each string) then runs as with a tokenizer."""
    if getattr(req_cls, "_final_stop_strings_installed", False):
        return
    check = req_cls.check_finished

    def check_finished(self) -> None:
        if self.tokenizer is not None or not self.sampling_params.stop_strs:
            return check(self)
        self.tokenizer = decoder
        try:
            return check(self)
        finally:
            self.tokenizer = None

    req_cls.check_finished = check_finished
    req_cls._final_stop_strings_installed = True


def install(scheduler_cls: type) -> None:
    if getattr(scheduler_cls, "_final_cartridges_installed", False):
        return
    flush, resume = scheduler_cls.flush_cache, scheduler_cls.resume_memory_occupation

    def flush_cache(self, *args: Any, **kwargs: Any) -> bool:  # 0.5.12 adds empty_cache=True
        ok = flush(self, *args, **kwargs)
        if ok:
            _state(self)["locked"].clear()  # the tree was reset: its nodes are gone
            if KV_CACHE_TAG not in self.offload_tags:
                _reinject(self)
        return ok

    def resume_memory_occupation(self, recv_req):
        out = resume(self, recv_req)
        if recv_req.tags is None or KV_CACHE_TAG in recv_req.tags:
            _reinject(self)  # released memory came back without its content
        return out

    scheduler_cls.flush_cache = flush_cache
    scheduler_cls.resume_memory_occupation = resume_memory_occupation
    scheduler_cls.final_cartridge_load = _rpc_method(_load)
    scheduler_cls.final_cartridge_compose = _rpc_method(_compose)
    scheduler_cls.final_cartridge_unload = _rpc_method(_unload)
    scheduler_cls.final_cartridge_release = _rpc_method(_release)
    scheduler_cls.final_cartridge_memory = _rpc_method(_memory)
    scheduler_cls._final_cartridges_installed = True


def _rpc_method(fn: Callable[[Any, dict], None]) -> Callable:
    """An RPC method for either release: 0.5.2 passes the parameters as one dict, 0.5.12 as keyword arguments."""
    def method(self, params: dict | None = None, **kwargs: Any) -> None:
        return fn(self, params if params is not None else kwargs)

    return method


@functools.cache
def _cache_params() -> tuple | None:
    """0.5.12's parameter classes for radix-cache calls, or None on 0.5.2 (plain arguments)."""
    try:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
    except ImportError:
        return None
    return MatchPrefixParams, InsertParams, EvictParams, RadixKey


def _match(cache, ids: list[int]):
    api = _cache_params()
    # extra_key None: what a request without lora or cache_salt is matched under (Req.extra_key)
    return cache.match_prefix(ids) if api is None else cache.match_prefix(api[0](key=api[3](ids)))


def _insert(cache, ids: list[int], slots: torch.Tensor) -> None:
    api = _cache_params()
    cache.insert(ids, slots) if api is None else cache.insert(api[1](key=api[3](ids), value=slots))


def _evict(cache, tokens: int) -> None:
    api = _cache_params()
    cache.evict(tokens) if api is None else cache.evict(api[2](num_tokens=tokens))


def _state(sched) -> dict:
    if not hasattr(sched, "_final_cartridges"):
        # store: id -> (reserved token, [K_l], [V_l]) resident on the pool's device, each [T, H_kv, D]
        # wanted: compositions to keep injected; locked: composition -> its locked radix node
        sched._final_cartridges = {"store": {}, "wanted": [], "locked": {}}
    return sched._final_cartridges


def _pool(sched):
    cache = sched.tree_cache
    if type(cache).__name__ != "RadixCache" or getattr(cache, "disable", False):
        raise RuntimeError(f"cartridges need SGLang's plain radix cache; this engine uses {type(cache).__name__}"
                           f"{' (disabled)' if getattr(cache, 'disable', False) else ''}: do not set "
                           f"disable_radix_cache, hierarchical cache or LoRA (on 0.5.12, deterministic inference disables the radix "
                           f"cache unless the attention backend is fa3 or triton)")
    if cache.page_size != 1:
        raise RuntimeError(f"cartridges need page_size 1, the engine has page_size {cache.page_size}")
    pool = sched.token_to_kv_pool_allocator.get_kvcache()
    if not hasattr(pool, "k_buffer") or pool.store_dtype != pool.dtype:
        raise RuntimeError(f"cartridges need an MHA KV pool in the model dtype; got {type(pool).__name__} "
                           f"storing {getattr(pool, 'store_dtype', '?')}")
    return pool


def _load(sched, params: dict) -> None:
    from safetensors.torch import load_file

    pool = _pool(sched)
    tensors = load_file(params["path"], device="cpu")  # not the pool's device: see _resident
    layers = pool.layer_num
    keys = [_resident(tensors[f"k.{i}"], pool) for i in range(layers) if f"k.{i}" in tensors]
    values = [_resident(tensors[f"v.{i}"], pool) for i in range(layers) if f"v.{i}" in tensors]
    if len(keys) != layers or len(values) != layers or len(tensors) != 2 * layers:
        raise RuntimeError(f"cartridge {params['cartridge_id']!r} has {len(tensors) // 2} layers, the model {layers}")
    expected = (keys[0].shape[0], pool.head_num, pool.head_dim)
    for t in keys + values:
        if tuple(t.shape) != expected:
            raise RuntimeError(f"cartridge {params['cartridge_id']!r}: KV of shape {tuple(t.shape)}, the pool needs "
                               f"[T, {pool.head_num}, {pool.head_dim}]")
    cid, store = params["cartridge_id"], _state(sched)["store"]
    store[cid] = (int(params["reserved"]), keys, values)
    try:
        _compose(sched, {"cartridge_ids": [cid]})
    except BaseException:  # all or nothing: a cartridge that could not be injected leaves no trace here
        store.pop(cid, None)
        raise


def _resident(t: torch.Tensor, pool) -> torch.Tensor:
    """The scheduler's own copy of a cartridge, kept in host memory: on the GPU it would sit outside SGLang's
    mem_fraction_static budget, twice (besides its pool slots), and survive release_memory_occupation. Pinned on
    CUDA, so that re-injecting after a flush is one fast host-to-device copy."""
    t = t.to(pool.dtype).contiguous()
    return t.pin_memory() if torch.device(pool.device).type == "cuda" else t


def _memory(sched, params: dict) -> None:
    """Write where cartridge KV lives, as JSON to params["path"] (collective_rpc returns no value)."""
    import json

    state = _state(sched)
    on_cuda = torch.device(sched.token_to_kv_pool_allocator.get_kvcache().device).type == "cuda"
    tensors = [t for _, ks, vs in state["store"].values() for t in ks + vs]
    slots: set[int] = set()
    for ids in state["locked"]:
        slots.update(_match(sched.tree_cache, _key(state, ids)).device_indices.tolist())
    report = {"host_bytes": sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cpu"),
              "device_bytes": sum(t.numel() * t.element_size() for t in tensors if t.device.type != "cpu"),
              "pinned": all(t.is_pinned() for t in tensors) if tensors and on_cuda else None,
              "pool_tokens": len(slots), "pool_free": sched.token_to_kv_pool_allocator.available_size(),
              "kv_released": KV_CACHE_TAG in sched.offload_tags}
    with open(params["path"], "w") as f:
        json.dump(report, f)


def _compose(sched, params: dict) -> None:
    ids = tuple(params["cartridge_ids"])
    state = _state(sched)
    missing = [c for c in ids if c not in state["store"]]
    if missing:
        raise RuntimeError(f"cartridges {missing} are not loaded in the scheduler")
    _inject(sched, ids)  # wanted only once injected: a failed injection is not retried at every flush
    if ids not in state["wanted"]:
        state["wanted"].append(ids)


def _release(sched, params: dict) -> None:
    """Stop holding a composition (the parent bounds how many it keeps): its slots become evictable."""
    _forget(sched, _state(sched), tuple(params["cartridge_ids"]))


def _forget(sched, state: dict, ids: tuple[str, ...]) -> None:
    if ids in state["wanted"]:
        state["wanted"].remove(ids)
    node = state["locked"].pop(ids, None)
    if node is not None:  # evictable from now on; its reserved ids are not reused before the next flush
        sched.tree_cache.dec_lock_ref(node)


def _unload(sched, params: dict) -> None:
    cid = params["cartridge_id"]
    state = _state(sched)
    for ids in [w for w in state["wanted"] if cid in w]:
        _forget(sched, state, ids)
    state["store"].pop(cid, None)


def _reinject(sched) -> None:
    """Inject what is wanted again. Runs inside SGLang's flush_cache / resume: an exception there would kill the
    scheduler, so a composition that no longer fits is logged and left out (a request for it then fails its
    cache-hit check with an error, never an answer from other KV); the next flush tries it again."""
    for ids in list(_state(sched)["wanted"]):
        try:
            _inject(sched, ids)
        except Exception:  # see above: never out of flush_cache
            logger.exception("cartridges %s could not be injected again", ids)


def _key(state: dict, ids: tuple[str, ...]) -> list[int]:
    """The reserved token ids R a composition is cached under: each cartridge's id repeated over its length."""
    return [r for c in ids for reserved, ks, _ in [state["store"][c]] for r in [reserved] * ks[0].shape[0]]


def _inject(sched, ids: tuple[str, ...]) -> None:
    """Write the composition's KV into pool slots cached under its reserved ids R, and lock them. All of R's slots
    are written, the cached ones too: a cached prefix of R need not be ours (a prompt of reserved ids sent before
    the load, a cartridge unloaded with that id still cached), and its slots hold whatever computed them. Nothing
    is left behind on failure (fresh slots are freed)."""
    state = _state(sched)
    if ids in state["locked"]:
        return
    pool = _pool(sched)
    cache, allocator = sched.tree_cache, sched.token_to_kv_pool_allocator
    parts = [state["store"][c] for c in ids]
    key = _key(state, ids)
    matched = _match(cache, key)
    have = matched.device_indices.to(torch.int64)
    need = len(key) - len(have)
    fresh = _alloc(sched, need, matched.last_device_node) if need > 0 else have[:0]
    slots = torch.cat([have, fresh.to(torch.int64)])
    try:
        for layer in range(pool.layer_num):
            k = torch.cat([ks[layer] for _, ks, _ in parts])
            v = torch.cat([vs[layer] for _, _, vs in parts])
            pool.k_buffer[layer][slots] = k.to(pool.device, non_blocking=True)
            pool.v_buffer[layer][slots] = v.to(pool.device, non_blocking=True)
        if need > 0:
            _insert(cache, key, slots)
    except BaseException:
        if need > 0:
            allocator.free(fresh)
        raise
    node = _match(cache, key).last_device_node
    cache.inc_lock_ref(node)
    state["locked"][ids] = node
    logger.info("cartridges %s injected: %d tokens (%d new slots)", ids, len(key), max(need, 0))


def _alloc(sched, need: int, matched) -> torch.Tensor:
    """`need` free pool slots, evicting unlocked cache entries if needed, but not the cached prefix `matched`
    that the injection reuses (locked meanwhile)."""
    cache, allocator = sched.tree_cache, sched.token_to_kv_pool_allocator
    fresh = allocator.alloc(need)
    if fresh is None:
        cache.inc_lock_ref(matched)
        try:
            _evict(cache, need)
        finally:
            cache.dec_lock_ref(matched)
        fresh = allocator.alloc(need)
    if fresh is None:
        raise RuntimeError(f"no room for {need} cartridge tokens in the KV pool "
                           f"({allocator.available_size()} free); raise mem_fraction_static")
    return fresh
