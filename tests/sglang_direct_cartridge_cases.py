"""Cartridges and token streams on the verl09 lane's SGLang backend (final/rollout/sglang/rollout_0512.py), on the
real SGLang 0.5.12 on CPU: KV injected by final's code in the scheduler child into SGLang 0.5.12's radix cache and
KV pool (its MatchPrefixParams/InsertParams API), locked, re-injected after a flush, shared by rows, composed in
request order. The embedded engine's own cartridge prefix is the reference: DataProtos equal to LocalRollout's,
log-probs within 1e-4. The verl06 lane's tests/test_sglang_cartridges.py, mirrored; one SGLang engine serves all.

Run by tests/test_sglang_direct.py in a process of its own (see tests/sglang_direct_cases.py for why)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from final import compat
from sglang_helpers import assert_same_output, dataproto, use_sglang_cpu
from test_sglang_cartridges import DOC, QUESTION, ask, cartridge_engines

pytestmark = pytest.mark.skipif(compat.LANE != "verl09", reason="the verl09 lane's backend (SGLang 0.5.12); the "
                                "verl06 lane's is tests/test_sglang_cartridges.py")
ROWS = [[1, 504, 3456, 28, 253], [1, 17, 99], [1, 2035, 441, 873, 12, 9]]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    yield from cartridge_engines(tmp_path_factory)


def same_dataproto(sglang, local, cartridges) -> None:
    """rollout.generate_sequences on both engines, each row with its cartridges: equal key for key."""
    rows = ROWS[:len(cartridges)]
    meta = {"do_sample": False}
    a = sglang.rollout.generate_sequences(dataproto(sglang.model_config, rows, meta, {"cartridges": cartridges}))
    b = local.rollout.generate_sequences(dataproto(local.model_config, rows, meta, {"cartridges": cartridges}))
    assert "rollout_log_probs" in a.batch.keys()
    assert_same_output(a, b)


def test_a_built_cartridge_gives_localrollouts_dataproto(engines):
    sglang, local, _ = engines
    assert sglang.backend == "sglang" and sglang.rollout.cartridge_target.cartridge_ids() == ["bakery", "doc"]
    same_dataproto(sglang, local, [("doc",), (), ("doc", "bakery")])  # one, none, a composition in order
    with_cart = ask(sglang, cartridge="doc")
    assert with_cart == ask(local, cartridge="doc") and with_cart != ask(sglang)
    # the cartridge stands for the document: the same answer as prefilling it
    assert with_cart == ask(sglang, [{"role": "system", "content": DOC}, {"role": "user", "content": QUESTION}])


def test_rows_share_one_injection_and_a_flush_reinjects(engines):
    sglang, local, _ = engines
    rollout = sglang.rollout
    lengths = {c: len(rollout.engine.cartridges.prefix((c,))) for c in ("doc", "bakery")}
    before = rollout.cartridge_memory()
    rows = ask(sglang, [QUESTION] * 3, cartridge="bakery")
    assert rows == ask(local, [QUESTION] * 3, cartridge="bakery")
    after = rollout.cartridge_memory()
    # held once however many rows use it: the pool slots of the injected compositions, nothing per row
    assert after["pool_tokens"] == before["pool_tokens"] >= sum(lengths.values())
    assert after["device_bytes"] == 0 and after["host_bytes"] == sum(
        2 * 2 * 2 * 16 * 4 * n for n in lengths.values())  # K and V, 2 layers, 2 KV heads, head_dim 16, float32
    assert asyncio.run(rollout.engine.flush_cache())  # the radix cache emptied; what is loaded injected again
    assert rollout.cartridge_memory()["pool_tokens"] == before["pool_tokens"]
    assert ask(sglang, cartridge="bakery") == ask(local, cartridge="bakery")


def test_unload_frees_reload_and_reserved_ids(engines):
    from final.errors import CartridgeError, PromptError

    sglang, local, files = engines
    engine = sglang.rollout.engine
    reserved = engine.cartridges.prefix(("doc",))[0]
    with pytest.raises(PromptError, match="reserved for cartridges"):
        sglang.generate([reserved, 17, 99], max_tokens=2)  # a plain prompt may not start with a cartridge's id
    held = sglang.rollout.cartridge_memory()["pool_tokens"]
    assert sglang.unload_cartridge("doc") is True
    assert sglang.rollout.cartridge_memory()["pool_tokens"] < held  # unlocked: no longer held for it
    with pytest.raises(CartridgeError, match="unknown cartridge"):
        sglang.generate(QUESTION, cartridge="doc")
    with pytest.raises(PromptError, match="not loaded"):
        engine.cartridges.prefix(("doc",))
    with pytest.raises(PromptError, match="reserved for cartridges"):  # retired until the next flush
        sglang.generate([reserved, 17, 99], max_tokens=2)
    assert asyncio.run(engine.flush_cache())
    assert sglang.generate([reserved, 17, 99], max_tokens=2).completions
    sglang.load_cartridge(id="doc", path=str(files["doc"]))
    assert ask(sglang, cartridge="doc") == ask(local, cartridge="doc")


def test_a_cartridge_missing_from_the_cache_is_an_error_not_garbage(engines):
    from final.errors import EngineError

    sglang, local, files = engines
    engine = sglang.rollout.engine
    engine.engine.collective_rpc("final_cartridge_unload", cartridge_id="bakery")  # a lost re-injection
    assert asyncio.run(engine.flush_cache())
    with pytest.raises(EngineError, match="not served from SGLang's radix cache"):
        ask(sglang, cartridge="bakery")
    sglang.load_cartridge(id="bakery", path=str(files["bakery"]), force_redownload=True)  # replaced: injected again
    assert ask(sglang, cartridge="bakery") == ask(local, cartridge="bakery")


def test_bad_cartridges_and_requests_raise_typed_errors(engines):
    from final.errors import CartridgeError, PromptError

    sglang, _, _ = engines
    target = sglang.rollout.cartridge_target
    k = [torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16)]
    with pytest.raises(CartridgeError, match="one tensor per layer"):
        target.load_cartridge("bad", k[:1], k[:1])
    with pytest.raises(CartridgeError, match="the model needs"):
        target.load_cartridge("bad", [torch.zeros(1, 3, 5, 16)] * 2, [torch.zeros(1, 3, 5, 16)] * 2)
    room = [torch.randn(2, 3000, 16)] * 2  # the KV pool holds 2048 tokens (CPU_ARGS)
    with pytest.raises(CartridgeError, match="no room for 3000 cartridge tokens"):
        target.load_cartridge("huge", room, room)
    big = [torch.randn(2, 1010, 16) * 0.1, torch.randn(2, 1010, 16) * 0.1]  # context_length is 1024
    assert target.load_cartridge("huge", big, big) == 1010
    data = dataproto(sglang.model_config, [[17, 99, 1000]], non_tensor={"cartridges": [("huge",)]})
    with pytest.raises(PromptError, match="do not fit the context"):
        sglang.rollout.generate_sequences(data)
    assert target.unload_cartridge("huge") and not target.unload_cartridge("huge")
    assert ask(sglang) == ask(engines[1])  # still serving


def test_token_streams_with_and_without_a_cartridge(engines):
    """InferenceEngine.astream on SGLang 0.5.12: one update per token (cumulative ids), the last with its finish
    reason, the same tokens as generate; a cartridge's prefix is served from the cache in streams too."""
    sglang, _, _ = engines

    async def stream(**kw):
        updates = []
        async for row in sglang.astream(sglang.prepare(QUESTION, temperature=0, max_tokens=6, ignore_eos=True, **kw)):
            updates.append(row)
        return updates

    for kw in ({}, {"cartridge": "doc"}):
        updates = asyncio.run(stream(**kw))
        assert len(updates) == 6 and [len(u.output_ids) for u in updates] == list(range(1, 7))
        assert [u.finish_reason for u in updates] == [None] * 5 + ["length"]
        expected = sglang.generate(QUESTION, temperature=0, max_tokens=6, ignore_eos=True, **kw).token_ids[0]
        assert updates[-1].output_ids == expected


def test_final_serve_streams_tokens_with_a_cartridge(engines, tmp_path):
    """`final serve`'s cartridge route with stream: true over HTTP, on this engine: more than one chunk, adding up to
    the non-streamed answer."""
    import json

    import httpx

    from final.server.app import ServerThread, create_app

    sglang, _, _ = engines
    server = ServerThread(create_app(sglang, cartridge_dir=str(tmp_path)))
    body = {"model": "m", "prompt": QUESTION, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "cartridges": [{"id": "doc"}]}  # a loaded id needs no source
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            whole = http.post("/custom/cartridge/completions", json=body).json()["choices"][0]["text"]
            chunks = []
            with http.stream("POST", "/custom/cartridge/completions", json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks += [c["text"] for c in json.loads(line[6:])["choices"] if c.get("text")]
    finally:
        server.stop()
    assert len(chunks) > 1 and "".join(chunks) == whole


@pytest.mark.parametrize("layout,positions", [("june", "after_prefix"), ("later", "from_zero")])
def test_cartridges_repo_files_give_hf_logprobs(engines, tmp_path, layout, positions):
    """Both cartridges-repo conventions served exactly: a from_zero cartridge's keys are rotated at load."""
    from compat_helpers import JUNE_CONFIG, LATER_CONFIG, reference, write_run

    sglang, _, _ = engines
    ref = reference()
    config = {"june": JUNE_CONFIG, "later": LATER_CONFIG}[layout]
    last = write_run(tmp_path / layout, ref["keys"], ref["values"], layout=layout, config=config)
    cid = sglang.load_cartridge(id=f"repo-{layout}", path=str(last))
    score = sglang.score([ref["cont"]], cartridge=cid)[0]
    assert score.cached_tokens >= ref["p"]
    assert score.prompt_logprobs[1:] == pytest.approx(ref[positions], abs=2e-4)
    assert sglang.unload_cartridge(cid)


def test_a_trained_cartridge_gives_localrollouts_dataproto(engines, tmp_path):
    """A cartridge from `final cartridge train` (fact rows through the local engine, distilled on HF's model)."""
    from final.training.document.facts import write_fact_rows
    from final.training.settings import FactConfig, TrainConfig
    from final.training.train import train_cartridge

    sglang, local, _ = engines
    data = tmp_path / "rows.jsonl"
    write_fact_rows(local, DOC, data, FactConfig(top_k=5))
    out = tmp_path / "trained.pt"
    train_cartridge(local.config.model_path, data, out, TrainConfig(tokens=8, steps=2, batch=2), text=DOC,
                    progress=False)
    for eng in (local, sglang):
        eng.load_cartridge(id="trained", path=str(out))
    try:
        same_dataproto(sglang, local, [("trained",), ("trained",)])
        assert ask(sglang, cartridge="trained") != ask(sglang)
    finally:
        for eng in (local, sglang):
            eng.unload_cartridge("trained")


def test_a_failed_load_leaves_no_trace(engines, tmp_path):
    """Issue 43 finding 1 (see tests/sglang_cartridge_checks.py)."""
    from sglang_cartridge_checks import check_a_failed_load_leaves_no_trace

    check_a_failed_load_leaves_no_trace(engines, tmp_path, ask)


def test_a_prompt_of_reserved_ids_sent_before_a_load_changes_nothing(engines, tmp_path):
    """Issue 43 finding 2: on 0.5.12 nothing flushes after a single call, so the prompt stays cached until the load."""
    from sglang_cartridge_checks import check_reserved_id_prompts_sent_first_change_nothing

    check_reserved_id_prompts_sent_first_change_nothing(engines, tmp_path)


def test_compositions_are_bounded_and_checked_before_injection(engines):
    from sglang_cartridge_checks import check_compositions_bounded_and_checked_first

    check_compositions_bounded_and_checked_first(engines, ask)


def test_a_flush_leaves_the_callers_loop_serving(engines):
    """Issue 43 finding 5: the multi-turn path awaits flush_cache on the caller's loop; while SGLang's flush waits,
    another coroutine on that loop runs (it is what lets the flush finish here)."""
    import inspect
    import threading

    sglang, _, _ = engines
    engine = sglang.rollout.engine
    manager = engine.engine.tokenizer_manager
    real, other_ran, order = manager.flush_cache, threading.Event(), []

    async def flush_after_the_other_coroutine(*args, **kwargs):  # SGLang's flush, on the engine loop
        await asyncio.to_thread(other_ran.wait, 30)  # a bound, not a timing: the other coroutine sets it at once
        return await real(*args, **kwargs)

    async def as_multi_turn_does():
        flushed = engine.flush_cache()
        ok = await flushed if inspect.isawaitable(flushed) else flushed
        order.append("flush")
        return ok

    async def other():
        order.append("other")
        other_ran.set()

    async def both():
        return await asyncio.gather(as_multi_turn_does(), other())

    manager.flush_cache = flush_after_the_other_coroutine
    try:
        ok, _ = asyncio.run(both())
    finally:
        manager.flush_cache = real
    assert ok and order == ["other", "flush"]
