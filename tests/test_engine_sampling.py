"""Sampling semantics, stopping, SGLang output format, continuous batching and error handling of the engine."""

from __future__ import annotations

import asyncio
import math

import pytest

from final.engine.engine import EmbeddedEngine
from final.errors import CartridgeError, PromptError, SamplingError

PROMPT = [1, 504, 3458, 282, 4289, 30, 2]


def gen(engine: EmbeddedEngine, params: dict, ids=PROMPT, **kw):
    return engine.generate(ids, params, **kw)


def test_output_format_is_sglangs(tiny_engine):
    out = gen(tiny_engine, {"max_new_tokens": 5, "temperature": 0}, return_logprob=True)
    assert set(out) == {"output_ids", "meta_info"}
    meta = out["meta_info"]
    assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
            "output_token_logprobs", "input_token_logprobs"} <= set(meta)
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 5 and meta["cached_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(text is None for _, _, text in meta["output_token_logprobs"])


def test_seed_reproducible_and_batch_independent(tiny_engine):
    p = {"max_new_tokens": 8, "temperature": 1.0, "seed": 7}
    a = gen(tiny_engine, p)["output_ids"]
    b = gen(tiny_engine, p)["output_ids"]
    batch = tiny_engine.generate([PROMPT, [5, 6, 7], PROMPT], [p, {"max_new_tokens": 3}, p])
    assert a == b == batch[0]["output_ids"] == batch[2]["output_ids"]
    others = {tuple(gen(tiny_engine, {**p, "seed": s})["output_ids"]) for s in range(8, 14)}
    assert len(others) > 1  # different seeds give different samples


def test_n_expands_prompt_major(tiny_engine):
    outs = tiny_engine.generate([PROMPT, [9, 10]], {"max_new_tokens": 4, "temperature": 1.0, "n": 3, "seed": 1})
    assert len(outs) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [7, 7, 7, 2, 2, 2]
    single = tiny_engine.generate(PROMPT, {"max_new_tokens": 4, "n": 2, "temperature": 1.0})
    assert isinstance(single, list) and len(single) == 2


def test_greedy_equivalents(tiny_engine):
    greedy = gen(tiny_engine, {"max_new_tokens": 8, "temperature": 0})["output_ids"]
    assert gen(tiny_engine, {"max_new_tokens": 8, "temperature": 1.0, "top_k": 1})["output_ids"] == greedy
    assert gen(tiny_engine, {"max_new_tokens": 8, "temperature": 0.8, "top_p": 1e-6})["output_ids"] == greedy
    assert gen(tiny_engine, {"max_new_tokens": 8, "temperature": 0.8, "min_p": 1.0})["output_ids"] == greedy


def test_stop_token_ids_ignore_eos_and_min_new_tokens(tiny_engine):
    greedy = gen(tiny_engine, {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})["output_ids"]
    stop_at = greedy[3]
    out = gen(tiny_engine, {"max_new_tokens": 10, "temperature": 0, "stop_token_ids": [stop_at]})
    first = greedy.index(stop_at)
    assert out["output_ids"] == greedy[: first + 1]  # SGLang keeps the matched stop token
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    out = gen(tiny_engine, {"max_new_tokens": 10, "temperature": 0, "stop_token_ids": [stop_at], "ignore_eos": True})
    assert out["output_ids"] == greedy and out["meta_info"]["finish_reason"]["type"] == "length"
    out = gen(tiny_engine, {"max_new_tokens": 10, "temperature": 0, "stop_token_ids": [greedy[0]],
                            "min_new_tokens": 3})
    assert len(out["output_ids"]) >= 3 and greedy[0] not in out["output_ids"][:3]


def test_stop_strings(tiny_engine, tiny_tokenizer):
    greedy = gen(tiny_engine, {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})["output_ids"]
    text = tiny_tokenizer.decode(greedy[2:4])
    out = gen(tiny_engine, {"max_new_tokens": 10, "temperature": 0, "stop": text.strip()})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": text.strip()}
    assert len(out["output_ids"]) <= 4


def test_sampled_logprobs_are_temperature_scaled(tiny_engine, tiny_dir):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    out = gen(tiny_engine, {"max_new_tokens": 4, "temperature": 0.5, "seed": 3}, return_logprob=True)
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + out["output_ids"]])).logits[0].float()
    for i, (lp, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        ref = torch.log_softmax(logits[len(PROMPT) - 1 + i] / 0.5, -1)[tok].item()
        assert math.isclose(lp, ref, abs_tol=1e-4)


def test_penalties_change_the_distribution(tiny_engine):
    base = gen(tiny_engine, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})["output_ids"]
    rep = gen(tiny_engine, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "repetition_penalty": 2.0})
    pres = gen(tiny_engine, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "presence_penalty": 2.0})
    assert rep["output_ids"] != base or pres["output_ids"] != base
    assert len(set(pres["output_ids"])) >= len(set(base))


@pytest.mark.parametrize("params, field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"), ({"n": 0}, "n"), ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"min_p": 2}, "min_p"), ({"bogus": 1}, "bogus"), ({"regex": "(a+"}, "regex"), ({"seed": "x"}, "seed"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"regex": "a", "json_schema": "{}"}, "regex"),
])
def test_bad_sampling_params_are_typed_and_engine_keeps_serving(tiny_engine, params, field):
    with pytest.raises(SamplingError) as err:
        gen(tiny_engine, {"max_new_tokens": 2, **params})
    assert err.value.field == field
    assert len(gen(tiny_engine, {"max_new_tokens": 2})["output_ids"]) == 2


def test_bad_prompts(tiny_engine):
    with pytest.raises(PromptError):
        tiny_engine.generate([[]], {"max_new_tokens": 2})
    with pytest.raises(PromptError, match="vocabulary"):
        tiny_engine.generate([10**9], {"max_new_tokens": 2})
    with pytest.raises(PromptError, match="context window"):
        tiny_engine.generate([5] * 5000, {"max_new_tokens": 2})
    with pytest.raises(CartridgeError, match="unknown cartridge"):
        tiny_engine.generate(PROMPT, {"max_new_tokens": 2}, cartridges=("nope",))
    assert gen(tiny_engine, {"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1


def test_max_new_tokens_clipped_to_context(tiny_engine):
    long = list(range(10, 10 + 4090))
    out = gen(tiny_engine, {"max_new_tokens": 50, "temperature": 0, "ignore_eos": True}, ids=long)
    assert len(out["output_ids"]) == tiny_engine.max_model_len - len(long) - 1


def test_continuous_batching_requests_join_and_leave(tiny_engine):
    """A late request joins a running batch; every output equals its solo run (no cross-talk between rows)."""
    solo_long = gen(tiny_engine, {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True})["output_ids"]
    solo_short = gen(tiny_engine, {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}, ids=[3, 4, 5])
    steps_before = tiny_engine.stats.decode_steps

    async def scenario():
        long_task = asyncio.ensure_future(tiny_engine.async_generate(
            input_ids=PROMPT, sampling_params={"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}))
        while tiny_engine.stats.decode_steps < steps_before + 5:
            await asyncio.sleep(0.001)
        short = await tiny_engine.async_generate(
            input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
        assert not long_task.done()  # the short one joined and left while the long one ran
        return await long_task, short

    long_out, short_out = asyncio.run(scenario())
    assert long_out["output_ids"] == solo_long
    assert short_out["output_ids"] == solo_short["output_ids"]
    assert tiny_engine.stats.decode_steps - steps_before < 40 + 5  # shared steps, not sequential runs


def test_abort_request(tiny_engine):
    async def scenario():
        task = asyncio.ensure_future(tiny_engine.async_generate(
            input_ids=PROMPT, sampling_params={"max_new_tokens": 3000, "ignore_eos": True}, rid="victim"))
        await asyncio.sleep(0.05)
        tiny_engine.abort_request("victim")
        return await task

    out = asyncio.run(scenario())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < 3000
    assert gen(tiny_engine, {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_cancelled_caller_frees_its_row(tiny_engine):
    async def scenario():
        task = asyncio.ensure_future(tiny_engine.async_generate(
            input_ids=PROMPT, sampling_params={"max_new_tokens": 3000, "ignore_eos": True}))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    out = gen(tiny_engine, {"max_new_tokens": 3})
    assert out["meta_info"]["completion_tokens"] == 3
    assert tiny_engine.scheduler.running == []


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5}, {"top_p": 0.5}])
def test_samples_follow_the_model_distribution(tiny_engine, tiny_dir, params):
    """Empirical first-token frequencies over 2000 seeded draws match softmax(logits/T) after filtering."""
    import collections

    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0, -1].float()
    probs = torch.softmax(logits / params.get("temperature", 1.0), -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    cum = 0.0
    for rank, t in enumerate(order.tolist()):  # SGLang's top-k then top-p filter
        if rank >= params.get("top_k", 10**9) or cum > params.get("top_p", 1.0):
            break
        keep[t] = True
        cum += probs[t].item()
    target = torch.where(keep, probs, torch.zeros_like(probs))
    target /= target.sum()
    outs = tiny_engine.generate(PROMPT, {"max_new_tokens": 1, "n": 2000, "seed": 11, **params})
    seen = collections.Counter(o["output_ids"][0] for o in outs)
    assert set(seen) <= set(keep.nonzero().flatten().tolist())  # nothing outside the filter is ever drawn
    for t in target.argsort(descending=True)[:5].tolist():
        assert abs(seen[t] / 2000 - target[t].item()) < 0.04  # > 3 sigma at n=2000
