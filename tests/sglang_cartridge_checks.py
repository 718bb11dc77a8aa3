"""Issue 43's checks of SGLang cartridge injection, the same on both lanes (SGLang 0.5.2: tests/test_sglang_cartridges.py,
0.5.12: tests/sglang_direct_cartridge_cases.py), each on that file's shared engines (sglang, local, files): a failed
load leaves no trace, a prompt of reserved ids sent before a load changes nothing, compositions are bounded and
checked against the context before anything is locked. HF with the cartridge's KV is the reference."""

from __future__ import annotations

import asyncio

import pytest
import torch


def parts(sglang):
    """(the lane's engine wrapper, its SGLangCartridges, a flush that returns whether SGLang flushed)."""
    rollout = sglang.rollout
    if hasattr(rollout, "sglang_engine"):  # 0.5.2: veRL's engine on the rollout's owner thread
        engine = rollout.sglang_engine

        def flush():
            return rollout._call(lambda: asyncio.get_event_loop().run_until_complete(engine.flush_cache())).success

        def plain(ids):  # straight to the engine: veRL's flush after a generate call would hide the poison
            call = engine.async_generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
            return rollout._call(lambda: asyncio.get_event_loop().run_until_complete(call))
        return engine.cartridges, flush, plain
    engine = rollout.engine
    return engine.cartridges, lambda: asyncio.run(engine.flush_cache()), \
        lambda ids: sglang.generate(ids, max_tokens=1, temperature=0)


def repo_cartridge(sglang, tmp_path, cid):
    """Load the HF-built reference cartridge (compat_helpers) under `cid`; returns its reference."""
    from compat_helpers import JUNE_CONFIG, reference, write_run

    ref = reference()
    sglang.load_cartridge(id=cid, path=str(write_run(tmp_path / cid, ref["keys"], ref["values"], layout="june",
                                                     config=JUNE_CONFIG)))
    return ref


def assert_served_like_hf(sglang, cid, ref) -> None:
    score = sglang.score([ref["cont"]], cartridge=cid)[0]
    assert score.cached_tokens >= ref["p"]
    assert score.prompt_logprobs[1:] == pytest.approx(ref["after_prefix"], abs=2e-4)


def random_kv(dims, tokens):
    return [torch.randn(dims.kv_heads, tokens, dims.head_dim) * 0.1 for _ in range(dims.layers)]


def check_a_failed_load_leaves_no_trace(engines, tmp_path, ask) -> None:
    from final.errors import CartridgeError

    sglang, local, _ = engines
    carts, flush, _ = parts(sglang)
    assert flush()  # nothing cached but the cartridges: no room can be made by evicting
    free = sglang.rollout.cartridge_memory()["pool_free"]
    fill = random_kv(carts.dims, free - 200)
    assert sglang.rollout.cartridge_target.load_cartridge("fill", fill, fill) == free - 200
    try:
        held = sglang.rollout.cartridge_memory()["pool_tokens"]
        reserved = carts._free[0]
        big = random_kv(carts.dims, 600)
        with pytest.raises(CartridgeError, match="no room for 600 cartridge tokens"):
            sglang.rollout.cartridge_target.load_cartridge("failed", big, big)
        assert "failed" not in carts.cartridge_ids() and carts._free[0] == reserved
        assert sglang.rollout.cartridge_memory()["pool_tokens"] == held  # no slot kept for it
        ref = repo_cartridge(sglang, tmp_path, "after-failed")  # the failed one's reserved id, reused
        assert carts.prefix(("after-failed",))[0] == reserved
        assert flush()  # before issue 43, re-injecting "failed" here killed the scheduler
        assert_served_like_hf(sglang, "after-failed", ref)
        assert ask(sglang, cartridge="doc") == ask(local, cartridge="doc")
    finally:
        for cid in ("fill", "after-failed"):
            sglang.unload_cartridge(cid)
    assert flush() and ask(sglang) == ask(local)  # still serving


def check_reserved_id_prompts_sent_first_change_nothing(engines, tmp_path) -> None:
    sglang, _, _ = engines
    carts, flush, plain = parts(sglang)
    assert flush()
    reserved = carts._free[0]  # the id the next load reserves
    plain([reserved] * 8)  # cached under [reserved] * 8 (+ its answer) in the radix cache, never flushed here
    ref = repo_cartridge(sglang, tmp_path, "after-poison")
    try:
        assert carts.prefix(("after-poison",))[0] == reserved
        assert_served_like_hf(sglang, "after-poison", ref)
    finally:
        sglang.unload_cartridge("after-poison")


def check_compositions_bounded_and_checked_first(engines, ask) -> None:
    from final.errors import PromptError
    from sglang_helpers import dataproto
    from test_sglang_cartridges import QUESTION

    sglang, local, _ = engines
    carts = parts(sglang)[0]
    target = sglang.rollout.cartridge_target
    halves = [random_kv(carts.dims, 600) for _ in range(2)]  # each fits the context (1024), both do not
    for i, kv in enumerate(halves):
        target.load_cartridge(f"half{i}", kv, kv)
    try:
        held = sglang.rollout.cartridge_memory()["pool_tokens"]
        data = dataproto(sglang.model_config, [[17, 99, 1000]], non_tensor={"cartridges": [("half0", "half1")]})
        with pytest.raises(PromptError, match="do not fit the context"):
            sglang.rollout.generate_sequences(data)
        assert sglang.rollout.cartridge_memory()["pool_tokens"] == held  # refused before anything was locked
    finally:
        for i in range(2):
            target.unload_cartridge(f"half{i}")
    singles = sum(len(carts.prefix((c,))) for c in carts.cartridge_ids())
    lengths = {c: len(carts.prefix((c,))) for c in ("doc", "bakery")}
    bound, carts.max_compositions = carts.max_compositions, 1
    try:
        assert ask(sglang, [QUESTION], cartridge=[["bakery", "doc"]]) == ask(local, [QUESTION], cartridge=[["bakery", "doc"]])
        assert sglang.rollout.cartridge_memory()["pool_tokens"] == singles + lengths["doc"]
        assert ask(sglang, [QUESTION], cartridge=[["doc", "bakery"]]) == ask(local, [QUESTION], cartridge=[["doc", "bakery"]])
        # the least recently used composition was released: one composition's slots held, not two
        assert sglang.rollout.cartridge_memory()["pool_tokens"] == singles + lengths["bakery"]
        assert ask(sglang, [QUESTION], cartridge=[["bakery", "doc"]]) == ask(local, [QUESTION], cartridge=[["bakery", "doc"]])
    finally:
        carts.max_compositions = bound
