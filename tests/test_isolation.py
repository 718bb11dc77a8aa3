"""A bad request never hurts another, inside the engine (issue 13): a row whose logits are not finite, whose
sampling raises or whose step fails is aborted with the cause, and every other row completes with exactly the
tokens of a clean run. The poisons are real: a request that forbids every token (stop_token_ids = the whole
vocabulary with min_new_tokens), a cartridge of NaNs loaded with allow_nonfinite, a corrupt embedding row, and a
transient device fault in one forward pass."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
import torch

from conftest import tiny_config
from final.cartridges.format import save_cartridge
from final.engine.engine import EmbeddedEngine
from final.errors import SequenceError
from final.inf import InferenceEngine

PROMPTS = [[1, 504, 3458, 282, 4289, 30, 2], [1, 1645, 2], [1, 2569, 316, 260, 2], [1, 77, 88, 99, 1234, 2]]
GOOD = [{"max_new_tokens": 12, "ignore_eos": True, "temperature": 1.0, "seed": 3},
        {"max_new_tokens": 9, "ignore_eos": True, "temperature": 0},
        {"max_new_tokens": 12, "ignore_eos": True, "temperature": 0.8, "top_k": 20, "seed": 11},
        {"max_new_tokens": 7, "ignore_eos": True, "temperature": 1.0, "top_p": 0.9, "seed": 5}]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = EmbeddedEngine(tiny_dir)
    yield eng
    eng.shutdown()


def _ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def test_a_row_that_cannot_be_sampled_is_aborted_alone(engine):
    """Fails on main: the sampler's error failed every row of the step (EngineError for all four requests)."""
    clean = _ids(engine.generate(PROMPTS, GOOD))
    poison = {"max_new_tokens": 8, "temperature": 1.0, "min_new_tokens": 4,
              "stop_token_ids": list(range(engine.spec.vocab_size))}  # no token may be sampled
    # the poisoned row sits between good ones: rows before it have drawn when the batch's sampling raises
    outs = engine.generate(PROMPTS[:2] + [PROMPTS[0]] + PROMPTS[2:], GOOD[:2] + [poison] + GOOD[2:])
    bad = outs.pop(2)
    assert bad["meta_info"]["finish_reason"]["type"] == "abort"
    assert "sampling failed" in bad["meta_info"]["finish_reason"]["message"]
    assert _ids(outs) == clean
    assert engine.generate(PROMPTS, GOOD)[0]["output_ids"] == clean[0]  # and the engine keeps serving


def test_a_failed_step_aborts_its_rows_only(engine):
    """A fault in one forward pass (a transient device error) cannot be pinned to a row: the rows of that step
    are aborted with the cause, requests still waiting run afterwards with their clean tokens."""
    clean = _ids(engine.generate(PROMPTS, GOOD))
    runner = engine.runner
    real = runner.decode

    def fail_once(seqs):
        runner.decode = real
        raise RuntimeError("device fault (injected)")

    engine.call(lambda r: setattr(r, "decode", fail_once))
    outs = engine.generate(PROMPTS, GOOD)
    reasons = [o["meta_info"]["finish_reason"] for o in outs]
    assert all(r["type"] == "abort" and "engine step failed: RuntimeError: device fault" in r["message"]
               for r in reasons)
    assert all(len(o["output_ids"]) == 1 for o in outs)  # the prefill's token, then the failed decode step
    assert _ids(engine.generate(PROMPTS, GOOD)) == clean


def test_a_failed_prefill_spares_the_running_rows(engine):
    clean = _ids(engine.generate(PROMPTS, GOOD))
    long = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}

    async def scenario():
        runner = engine.runner
        real = runner.prefill
        running = asyncio.ensure_future(engine.async_generate(input_ids=PROMPTS[0], sampling_params=long))
        while engine.stats.decode_steps == 0 or not engine.scheduler.running:
            await asyncio.sleep(0.01)

        def fail_once(seqs):
            runner.prefill = real
            raise RuntimeError("device fault in prefill (injected)")

        engine.call(lambda r: setattr(r, "prefill", fail_once))
        victims = await engine.async_generate(input_ids=PROMPTS, sampling_params=GOOD)
        return await running, victims

    alone = engine.generate(PROMPTS[0], long)["output_ids"]
    kept, victims = asyncio.run(scenario())
    assert all(v["meta_info"]["finish_reason"]["type"] == "abort" and v["output_ids"] == [] for v in victims)
    assert kept["meta_info"]["finish_reason"]["type"] == "length" and kept["output_ids"] == alone
    assert _ids(engine.generate(PROMPTS, GOOD)) == clean


def _nan_cartridge(engine: EmbeddedEngine, path, tokens: int = 6):
    spec = engine.spec
    keys = [torch.randn(1, spec.num_kv_heads, tokens, spec.head_dim) for _ in range(spec.num_layers)]
    values = [torch.randn(1, spec.num_kv_heads, tokens, spec.head_dim) for _ in range(spec.num_layers)]
    values[0][0, 0, 2, 1] = math.nan
    from final.cartridges.format import CartridgeKV

    return save_cartridge(CartridgeKV(keys, values, 1), path)


@pytest.fixture(scope="module")
def inference():
    eng = InferenceEngine(tiny_config(prompt_length=64, response_length=24, max_num_seqs=4))
    yield eng
    eng.shutdown()


def test_a_request_with_a_nan_cartridge_fails_alone(inference, tmp_path):
    """Fails on main: the NaN rows' draw raised in the shared step, and every concurrent request failed with it.
    The wave after it reuses the NaN rows' slots: their K/V were zeroed, so nothing leaks into later rows."""
    texts = ["The sky is", "Name a color.", "One, two,", "Tell me a joke about cats."]
    kw = {"max_tokens": 20, "ignore_eos": True, "temperature": 1.0}
    clean = inference.generate(texts, **kw, seed=4).token_ids  # row i samples with seed 4 + i
    path = _nan_cartridge(inference.engine, tmp_path / "nan.pt")
    spec = {"id": "nan", "path": str(path), "allow_nonfinite": True}

    async def scenario():
        good = [inference.agenerate(t, **kw, seed=4 + i) for i, t in enumerate(texts)]
        bad = inference.agenerate(["Where is it?", "And this?"], cartridge=[spec, None], max_tokens=20,
                                  temperature=1.0)
        return await asyncio.gather(bad, *good, return_exceptions=True)

    bad, *good = asyncio.run(scenario())
    assert isinstance(bad, SequenceError) and bad.row == 0 and "not finite" in str(bad)
    assert [g.token_ids[0] for g in good] == clean
    assert inference.generate(texts, **kw, seed=4).token_ids == clean
    assert inference.engine.stats.faults >= 1


def test_a_nan_row_leaves_nothing_behind_in_its_slot(engine):
    """A long NaN row leaves NaN K/V in its slot past where a short next occupant writes. Decode reads every row's
    slot up to the batch's longest row (masked), and a masked NaN still poisons the softmax unless it was zeroed."""
    spec = engine.spec
    keys = [torch.randn(1, spec.num_kv_heads, 4, spec.head_dim) for _ in range(spec.num_layers)]
    values = [k.clone() for k in keys]
    values[0][0, 0, 1, 0] = math.nan
    engine.load_cartridge("nan", keys, values)  # the engine's own API trusts its caller: no finiteness check
    short, long = [1, 504, 3458], [1] + list(range(300, 340)) + [2]
    greedy = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0}
    alone = engine.generate(short, greedy)["output_ids"]

    async def scenario():
        running = asyncio.ensure_future(engine.async_generate(  # slot 0 for the whole scenario
            input_ids=long, sampling_params={"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}))
        while not engine.scheduler.running:
            await asyncio.sleep(0.01)
        bad = await engine.async_generate(input_ids=long, sampling_params=greedy, cartridges=("nan",))  # slot 1
        after = await engine.async_generate(input_ids=short, sampling_params=greedy)  # slot 1 again
        engine.abort_request(abort_all=True)
        await running
        return bad, after

    bad, after = asyncio.run(scenario())
    engine.unload_cartridge("nan")
    assert "not finite" in bad["meta_info"]["finish_reason"]["message"]
    assert after["meta_info"]["finish_reason"]["type"] == "length" and after["output_ids"] == alone


@pytest.fixture()
def corrupt_token(inference):
    """One token's embedding row turned to NaN (a corrupt weight in the lookup), restored afterwards. The lookup
    gets its own copy first: SmolLM2's lm_head is the same tensor (tied, as in HF), so a NaN row there would make
    every request's logits NaN, not only those of prompts holding the token."""
    token = 4289
    model = inference.engine.model
    original = model.embed

    def corrupt(_r) -> None:
        model.embed = original.clone()
        model.embed[token].fill_(math.nan)

    inference.engine.call(corrupt)
    yield token
    inference.engine.call(lambda _r: setattr(model, "embed", original))


def test_http_a_poisoned_request_is_a_500_for_it_only(inference, corrupt_token):
    from final.server.app import ServerThread, create_app

    good = {"model": "m", "prompt": [1, 504, 3458], "max_tokens": 16, "ignore_eos": True, "temperature": 1.0,
            "seed": 9}
    with ServerThread(create_app(inference)) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        clean = http.post("/v1/completions", json=good).json()["system_fingerprint"]

        async def scenario():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                return await asyncio.gather(
                    client.post("/v1/completions", json={**good, "prompt": [1, corrupt_token, 2]}),
                    client.post("/v1/completions", json=good),
                    client.post("/v1/completions", json={**good, "stream": True}))

        bad, ok, stream = asyncio.run(scenario())
        assert bad.status_code == 500 and bad.json()["error"]["code"] == "sequence_aborted"
        assert "not finite" in bad.json()["error"]["message"]
        assert ok.status_code == 200 and ok.json()["system_fingerprint"] == clean
        assert stream.status_code == 200 and "[DONE]" in stream.text and '"error"' not in stream.text
        assert http.post("/v1/completions", json=good).json()["system_fingerprint"] == clean
