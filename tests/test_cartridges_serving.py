"""Serving cartridges on the embedded engine, exactly: per-request and mixed batches, composition in request
order, positions continuing at the prefix length, and one shared copy of a cartridge for all its rows."""

from __future__ import annotations

import asyncio

import pytest
import torch
from cartridges_helpers import greedy, open_engine

from final.cartridges.build import build_from_text, continuation_ids, document_ids, verify
from final.cartridges.footprint import kv_footprint, measure_sharing
from final.cartridges.format import CartridgeKV, save_cartridge
from final.cartridges.service import CartridgeService

DOC_A = "Zorblat the cat lives in a red house on Mill Street and eats fish every Tuesday."
DOC_B = "The old clock tower in Brenford strikes thirteen times at midnight."


@pytest.fixture(scope="module")
def env():
    engine, tok = open_engine()
    service = CartridgeService(engine)
    a_ids, b_ids = document_ids(tok, DOC_A), document_ids(tok, DOC_B)
    service.add("a", build_from_text(engine, a_ids))
    service.add("b", build_from_text(engine, b_ids))
    yield engine, tok, service, a_ids, b_ids
    engine.shutdown()


def test_cartridge_equals_document_in_the_prompt(env):
    engine, tok, service, a_ids, _ = env
    q = continuation_ids(tok, "What does the cat eat?")
    assert greedy(engine, q, 16, cartridges=("a",)) == greedy(engine, a_ids + q, 16)
    out = engine.generate(q, {"max_new_tokens": 2}, cartridges="a")
    assert out["meta_info"]["cached_tokens"] == len(a_ids)  # served from the cartridge, not prefilled
    assert out["meta_info"]["prompt_tokens"] == len(a_ids) + len(q)
    report = verify(engine, build_from_text(engine, a_ids), a_ids, [q, continuation_ids(tok, "Where?")], 16)
    assert report.max_logit_diff < 1e-4 and report.token_agreement == 1.0


def test_no_second_bos_after_the_cartridge(env):
    _, tok, _, a_ids, _ = env
    q = continuation_ids(tok, "What does the cat eat?")
    full = tok.apply_chat_template([{"role": "system", "content": DOC_A}, {"role": "user", "content":
                                    "What does the cat eat?"}], tokenize=False, add_generation_prompt=True)
    # The cartridge plus its continuation is exactly the tokenized conversation: nothing inserted between them.
    assert a_ids + q == tok(full, add_special_tokens=False).input_ids
    raw_doc, raw_q = document_ids(tok, DOC_A, chat=False), continuation_ids(tok, " Why?", chat=False)
    assert raw_doc[0] == tok.bos_token_id and tok.bos_token_id not in raw_q


def test_different_cartridges_in_one_batch(env):
    engine, tok, _, _, _ = env
    qs = [continuation_ids(tok, t) for t in ("What does the cat eat?", "When does it strike?", "Hello!")]
    rows = [(qs[0], ("a",)), (qs[1], ("b",)), (qs[2], ()), (qs[1], ("a",)), (qs[0], ("a", "b")), (qs[2], ("b",))]
    singles = [greedy(engine, q, 16, cartridges=c) for q, c in rows]
    batch = engine.generate([q for q, _ in rows], {"max_new_tokens": 16, "temperature": 0.0},
                            cartridges=[c for _, c in rows])
    assert [o["output_ids"] for o in batch] == singles
    assert len({tuple(s) for s in singles}) > 2  # the rows really differ: no row saw another's cartridge


def test_composition_follows_request_order_and_positions(env):
    """(A, B') where B' is B's KV computed after A is exactly the prefill of A + B, the prompt at p_A + p_B."""
    engine, tok, service, a_ids, b_ids = env
    both = build_from_text(engine, a_ids + b_ids)
    p = len(a_ids)
    service.add("b_after_a", CartridgeKV([k[:, :, p:] for k in both.keys], [v[:, :, p:] for v in both.values]))
    try:
        q = continuation_ids(tok, "What happens at midnight?")
        composed = greedy(engine, q, 16, cartridges=("a", "b_after_a"))
        assert composed == greedy(engine, a_ids + b_ids + q, 16)
        out = engine.generate(q, {"max_new_tokens": 1}, cartridges=["a", "b_after_a"])
        assert out["meta_info"]["cached_tokens"] == len(a_ids) + len(b_ids)
        # Logits, not only tokens: the merged-attention path against a plain prefill of the concatenation.
        prefix = engine.prefixes.get(("a", "b_after_a"))
        # Request order is storage order: A's tokens first, then B's (attention itself is order-free over keys,
        # which carry their RoPE positions; the prompt's positions start after both).
        assert torch.equal(prefix.k[1][:, :p], engine.prefixes.get(("a",)).k[1])
        assert torch.equal(prefix.k[1][:, p:], engine.prefixes.get(("b_after_a",)).k[1])
        ref, _ = engine.call(lambda r: r.forward_full(a_ids + b_ids + q, None))
        got, _ = engine.call(lambda r: r.forward_full(q, prefix))
        assert (ref[len(a_ids) + len(b_ids):] - got).abs().max().item() < 1e-4
    finally:
        service.unload("b_after_a")


def test_rows_sharing_a_cartridge_share_one_copy(env):
    engine, tok, service, a_ids, _ = env
    q = continuation_ids(tok, "What does the cat eat?")
    cart_bytes = engine.prefixes.get(("a",)).nbytes
    engine.release_memory_occupation()
    one = measure_sharing(engine, ("a",), q, rows=1)
    engine.release_memory_occupation()
    many = measure_sharing(engine, ("a",), q, rows=32)
    engine.release_memory_occupation()
    plain = measure_sharing(engine, (), q, rows=32)
    assert many["running_rows"] == many["rows_with_cartridge"] == 32 and many["distinct_prefixes"] == 1
    assert one["prefix_bytes"] == many["prefix_bytes"] == cart_bytes  # 1 copy for 32 rows, not 32
    assert many["row_cache_bytes"] == plain["row_cache_bytes"]  # rows hold only their own tokens
    assert kv_footprint(engine)["running_rows"] == 0


def test_tokasaurus_specs_and_reload_while_in_use(env, tmp_path):
    engine, tok, service, a_ids, _ = env
    path = str(save_cartridge(build_from_text(engine, a_ids), tmp_path / "a.pt"))
    ids = service.ensure([{"id": path, "source": "local", "force_redownload": False}])
    assert ids == (path,) and path in engine.cartridge_ids()
    q = continuation_ids(tok, "What does the cat eat?")
    want = greedy(engine, a_ids + q, 8)

    async def request():
        with service.using([({"id": path, "source": "local"},)]):  # one row, its cartridges as specs
            out = await engine.async_generate(input_ids=q, sampling_params={"max_new_tokens": 8, "temperature": 0.0},
                                              cartridges=ids)
            return out["output_ids"], service.store.get(path).refcount

    got, refs = asyncio.run(request())
    assert got == want and refs == 1 and service.store.get(path).refcount == 0
    with service.using([path]):  # a reload (force_redownload) keeps the in-use reference
        service.ensure([{"id": path, "source": "local", "force_redownload": True}])
        assert service.store.get(path).refcount == 1
    assert greedy(engine, q, 8, cartridges=(path,)) == want
    service.unload(path)
    assert torch.equal(torch.tensor(greedy(engine, q, 8, cartridges=("a",))), torch.tensor(want))
